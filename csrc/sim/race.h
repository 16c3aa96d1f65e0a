// The race flavour's shared-memory race checker, driven by the runtime (block starts, barriers,
// fiber switches). In the other flavours these are no-ops. See race.cpp.
#pragma once

#include <cstddef>

namespace dspark_sim::race {

#if defined(DSPARK_SIM_RACE)
void set_stack_range(const void* begin, const void* end);  // fiber stacks: thread-private
void switch_to(int tid);                                    // -1: the host (the scheduler)
void barrier();                                             // a __syncthreads completed
void begin_block(const void* dynamic_shared, size_t bytes);
void end_block();
#else
inline void set_stack_range(const void*, const void*) {}
inline void switch_to(int) {}
inline void barrier() {}
inline void begin_block(const void*, size_t) {}
inline void end_block() {}
#endif

}  // namespace dspark_sim::race
