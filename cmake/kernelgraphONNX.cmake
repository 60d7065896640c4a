# Defines the imported target kernelgraph::onnx (the ONNX protobuf schema compiled by Debian's
# libonnx-dev, libonnx_proto, and libprotobuf) unless it exists. Used by kernelgraph's build and by
# its installed package, whose static library needs both to link. Sets nothing when one is missing.
if(NOT TARGET kernelgraph::onnx)
  find_path(KG_ONNX_INCLUDE onnx/onnx-ml.pb.h)
  find_library(KG_ONNX_PROTO NAMES onnx_proto)
  find_library(KG_PROTOBUF NAMES protobuf)
  if(KG_ONNX_INCLUDE AND KG_ONNX_PROTO AND KG_PROTOBUF)
    add_library(kernelgraph::onnx INTERFACE IMPORTED)
    set_target_properties(kernelgraph::onnx PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${KG_ONNX_INCLUDE}"
      INTERFACE_COMPILE_DEFINITIONS "ONNX_NAMESPACE=onnx;ONNX_ML=1"
      INTERFACE_LINK_LIBRARIES "${KG_ONNX_PROTO};${KG_PROTOBUF}")
  endif()
endif()
