// Rendering Graphviz DOT text to an image with graphviz's `dot` program.
#pragma once

#include <string>
#include <vector>

namespace kg::dump {

// File extensions render_dot() understands: "svg", "png", "pdf" (through `dot`), and "dot",
// "gv" (the text itself).
std::vector<std::string> render_formats();

// The format render_dot() writes for `path`, from its extension in lower case ("svg");
// throws kg::Error naming the known extensions when there is none or it is unknown.
std::string render_format(const std::string& path);

// Writes `dot_text` to `path` in the format its extension names, running
// `<dot_program> -T<format> -o <path>` for images. Throws kg::Error for an unknown extension,
// when the program cannot be found (naming it and graphviz), or when it fails (with its
// exit status and its error output).
void render_dot(const std::string& dot_text, const std::string& path, const std::string& dot_program = "dot");

}  // namespace kg::dump
