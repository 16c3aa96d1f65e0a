// The CUDA glue and kernels of the random family, compiled by g++ against the emulator.
#include "../glue.h"

#include "../../cuda/random_cuda.cu"
