#!/usr/bin/env bash
# Developer build: compile exactblocks._core into build/dev and place it in src/exactblocks/,
# so that `PYTHONPATH=src python -m pytest` runs against the working tree without reinstalling.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$py")" \
  -DSKBUILD_PROJECT_VERSION="$("$py" -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')" >/dev/null
cmake --build build/dev -j 2
cp build/dev/_core*.so src/exactblocks/
# Keep the checked-in type stub of the extension current (STYLE 2: nanobind stubgen output);
# a failing stub generator fails the build script.
PYTHONPATH=src "$py" -m nanobind.stubgen -m exactblocks._core -o src/exactblocks/_core.pyi -q
