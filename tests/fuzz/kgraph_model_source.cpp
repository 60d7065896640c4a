// The kgraph tool's MODEL and --dim parsing (tools/kgraph/model_source.cpp), compiled into the test
// suite for the fuzz regression replay: kg_tests does not link the tool, and fuzz_cli
// (fuzz/targets.hpp) calls parse_dim.
#include "../../tools/kgraph/model_source.cpp"
