// The CUDA glue, launchers and kernels of the scheduling family, compiled by g++ against the
// emulator.
#include "../glue.h"

#include "../../cuda/schedule_launch.cu"
#include "../../cuda/schedule_cuda.cpp"
