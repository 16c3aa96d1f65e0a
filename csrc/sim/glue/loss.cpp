// The CUDA glue and kernel of the loss family, compiled by g++ against the emulator.
#include "../glue.h"

#include "../../cuda/loss_cuda.cu"
