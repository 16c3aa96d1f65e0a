// The CUDA glue, launchers and kernels of the drafting family, compiled by g++ against the
// emulator.
#include "../glue.h"

#include "../../cuda/draft_launch.cu"
#include "../../cuda/draft_cuda.cpp"
