// Drawing pictures with matplotlib: the tools hand the data, as JSON, to one checked-in
// script, tools/plot/pipeshard_plot.py, run by Debian's Python (python3-matplotlib).
//
// The interpreter is /usr/bin/python3 unless the environment variable PIPESHARD_PYTHON
// names another. The script is looked for beside the running executable (the build
// copies it into bin/), then in the source tree this binary was built from.
// Pictures are .svg or .png, chosen by the extension, and are written atomically (a
// temporary file in the same folder, renamed over the target).
#ifndef PIPESHARD_TOOLS_PLOT_PLOT_H_
#define PIPESHARD_TOOLS_PLOT_PLOT_H_

#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace pipeshard {

// Checks, before any work, that a picture can be drawn to `path`: it ends in .svg or
// .png, its folder exists and takes a new file, and the interpreter runs the script
// and imports matplotlib. Takes about a tenth of a second (one interpreter start).
// The error is one line that says which of these failed.
Status check_picture_output(const std::string& path);

// Draws the picture `data` describes (an object with "kind": "partition" or "train";
// tools/plot/pictures.h makes both) to `path`. Errors carry the script's last line.
Status draw_picture(const nlohmann::json& data, const std::string& path);

}  // namespace pipeshard

#endif  // PIPESHARD_TOOLS_PLOT_PLOT_H_
