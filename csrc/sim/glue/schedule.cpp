// The CUDA glue and kernels of the schedule family, compiled by g++ against the emulator.
#include "../glue.h"

#include "../../cuda/schedule_cuda.cu"
