// The CUDA glue and kernels of the draft family, compiled by g++ against the emulator.
#include "../glue.h"

#include "../../cuda/draft_cuda.cu"
