// The CUDA glue, launchers and kernels of the attention family, compiled by g++ against the
// emulator.
#include "../glue.h"

#include "../../cuda/attention_launch.cu"
#include "../../cuda/attention_cuda.cpp"
