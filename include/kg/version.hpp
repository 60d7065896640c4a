// kernelgraph's version. Kept equal to project(kernelgraph VERSION ...) in CMakeLists.txt: the
// configure step fails when the two differ, and a test compares them.
#pragma once

#define KG_VERSION_MAJOR 0
#define KG_VERSION_MINOR 1
#define KG_VERSION_PATCH 0

#define KG_VERSION_STRINGIFY_(x) #x
#define KG_VERSION_STRINGIFY(x) KG_VERSION_STRINGIFY_(x)
// "MAJOR.MINOR.PATCH"
#define KG_VERSION_STRING                                                                  \
  KG_VERSION_STRINGIFY(KG_VERSION_MAJOR) "." KG_VERSION_STRINGIFY(KG_VERSION_MINOR) "." \
      KG_VERSION_STRINGIFY(KG_VERSION_PATCH)

