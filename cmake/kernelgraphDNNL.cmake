# Defines the imported target kernelgraph::dnnl (oneDNN, Debian's libdnnl-dev: libdnnl and the
# folder of oneapi/dnnl/dnnl.hpp) unless it exists. Used by kernelgraph's build and by its
# installed package, whose static library then needs oneDNN to link. Sets nothing when oneDNN is
# not found: the CPU backend then runs every convolution and pooling on its own kernels.
if(NOT TARGET kernelgraph::dnnl)
  find_library(KG_DNNL NAMES dnnl)
  find_path(KG_DNNL_INCLUDE oneapi/dnnl/dnnl.hpp)
  if(KG_DNNL AND KG_DNNL_INCLUDE)
    add_library(kernelgraph::dnnl UNKNOWN IMPORTED)
    set_target_properties(kernelgraph::dnnl PROPERTIES IMPORTED_LOCATION "${KG_DNNL}"
                                                       INTERFACE_INCLUDE_DIRECTORIES "${KG_DNNL_INCLUDE}")
  endif()
endif()
