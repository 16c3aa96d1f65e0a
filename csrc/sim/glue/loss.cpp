// The CUDA glue, launcher and kernels of the loss family, compiled by g++ against the emulator.
#include "../glue.h"

#include "../../cuda/loss_launch.cu"
#include "../../cuda/loss_cuda.cpp"
