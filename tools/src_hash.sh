#!/bin/bash
# One hash of everything the extension's build reads (and the package it installs), so a build
# made on one machine (tools/gpu_prebuild.sh) is known to be this tree's on another
# (tools/gpu_machine.sh). Run in the repository root.
find cpp cuda vulkan python CMakeLists.txt pyproject.toml -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 |
  LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
