// The CUDA glue, launcher and kernels of the random family, compiled by g++ against the emulator.
#include "../glue.h"

#include "../../cuda/random_launch.cu"
#include "../../cuda/random_cuda.cpp"
