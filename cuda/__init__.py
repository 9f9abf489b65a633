"""The CUDA kernels' sources (*.cu, *.cuh, flexevict_kernels.h, binding.cpp), installed as the
package `flexevict.cuda_sources` (setup.py) so that an installed flexevict, not only a source
checkout, can compile them on first GPU use (flexevict/core/kernels/build.py)."""
