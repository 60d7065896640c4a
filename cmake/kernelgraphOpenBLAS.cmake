# Defines the imported target kernelgraph::openblas (libopenblas, with the folder of its cblas.h)
# unless it exists. Used by kernelgraph's build and by its installed package, whose static library
# needs OpenBLAS to link. Sets nothing when the library is not found.
if(NOT TARGET kernelgraph::openblas)
  find_library(KG_OPENBLAS NAMES openblas)
  find_path(KG_CBLAS_INCLUDE cblas.h PATH_SUFFIXES openblas-pthread openblas)
  if(KG_OPENBLAS)
    add_library(kernelgraph::openblas UNKNOWN IMPORTED)
    set_target_properties(kernelgraph::openblas PROPERTIES IMPORTED_LOCATION "${KG_OPENBLAS}")
    if(KG_CBLAS_INCLUDE)
      set_target_properties(kernelgraph::openblas PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${KG_CBLAS_INCLUDE}")
    endif()
  endif()
endif()
