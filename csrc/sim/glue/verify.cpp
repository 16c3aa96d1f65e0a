// The CUDA glue, launchers and kernels of the verify family, compiled by g++ against the emulator.
#include "../glue.h"

#include "../../cuda/verify_launch.cu"
#include "../../cuda/verify_cuda.cpp"
