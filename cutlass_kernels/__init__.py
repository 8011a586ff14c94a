"""The build-time kernel generator of qops: the CUTLASS Python interface (nvidia-cutlass) emits the
sm_90a GEMMs from the config table in ``w8a8_configs`` (plain data, importable without CUTLASS).
Run from the repository root, e.g. ``python -m cutlass_kernels.gen_w8a8 --out DIR``; CMake does
this at configure time. Generated code goes to the build tree, never into git."""
