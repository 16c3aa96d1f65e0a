// The two constructs whose spelling differs between nvcc and the SIMT emulator (csrc/sim/), so the
// same kernel source runs on both: a kernel launch, and the declaration of dynamic shared memory.
// Under nvcc they are exactly <<<...>>> and extern __shared__; csrc/sim/prelude.h defines the
// emulator's versions before this file is seen.
#pragma once

#if !defined(DSPARK_OPS_SIM)
// DSPARK_LAUNCH(grid, block, dynamic shared bytes, stream, kernel)(arguments...)
#define DSPARK_LAUNCH(grid, block, shared, stream, ...) __VA_ARGS__<<<grid, block, shared, stream>>>
// DSPARK_EXTERN_SHARED(type, name): `type* name`, the block's dynamic shared memory (16-byte aligned)
#define DSPARK_EXTERN_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif
