// The SIMT emulator's interface: what the kernel-side shim (prelude.h) and the host-side glue
// (bindings.cpp, the fake c10 CUDA headers) call. Implemented in runtime.cpp, which is never
// compiled with the race instrumentation (it is the race checker).
//
// Model (CUDA C++ Programming Guide, "Programming Model" and "Warp Shuffle Functions"; PTX ISA,
// "bar.sync", "shfl.sync", "mma.sync"):
//   - a launch runs its blocks one at a time, in a seeded random order;
//   - each thread of a block is a fiber; a fiber runs until it reaches a synchronisation point
//     (__syncthreads, a warp shuffle, mma.sync, an atomic, a fence) and the scheduler then resumes a
//     ready fiber picked at random (seeded), so every run is one legal interleaving, reproducible
//     from the seed;
//   - __syncthreads completes when every thread of the block waits at the same barrier; waiting at
//     different barriers, or a barrier after some thread exited, is reported;
//   - a warp-collective operation completes when every lane named in its mask has reached the same
//     operation; a lane of the mask that exits or waits elsewhere, a lane outside its own mask, and
//     a read from a lane outside the mask are reported;
//   - launches are checked against an emulated device (block and grid limits, dynamic shared memory
//     against the opt-in limit and cudaFuncSetAttribute, __launch_bounds__).
//   - a kernel launched dependent (programmatic dependent launch) runs after the kernel before it,
//     as it does past its griddepcontrol.wait; a thread that exits without that wait is reported.
// Not modelled: timing, the weak memory model (a missing __threadfence is invisible), concurrent
// blocks (nor a dependent kernel's reads before its wait), hardware expf/log approximations and
// tensor-core summation order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace dspark_sim {

struct Site {
  const char* file;
  int line;
};

// The emulated GPU a launch is checked against (selected by name: "h200", "a100", "l4").
struct DeviceSpec {
  const char* name;
  int major, minor;
  int multiprocessors;
  int max_threads_per_sm;
  int max_blocks_per_sm;
  size_t shared_per_sm;        // bytes usable by blocks of one SM
  size_t shared_optin;         // the most one block may opt in to
  size_t shared_default = 48 * 1024;  // without cudaFuncSetAttribute
  int registers_per_sm = 64 * 1024;     // 32-bit registers, in four equal partitions
};

const DeviceSpec& device();
int device_ordinal();  // the emulated device's index: the key of the glue's per-device caches
bool set_device(const std::string& name);  // false for an unknown name
void set_seed(uint64_t seed);

// Fault injection for the tests that show the checks catch a broken kernel (empty = none):
//   "drop_barrier:<file>:<line>"   that __syncthreads does nothing
//   "shuffle_off_by_one"           every shuffle reads from the next lane
//   "mma_swap_a12"                 mma.sync takes A registers a1 and a2 swapped
// and one setting that is no fault but a legal execution the one-block-at-a-time order cannot
// produce (blocks that all run at once, none seeing another's writes yet):
//   "polls_see_launch_start"       poll_counter (prelude.h) returns 0, a polled counter's value
//                                  when the launch started
void set_plant(const std::string& plant);
bool polls_see_launch_start();

// Per-thread state of the running kernel; null outside a kernel.
struct ThreadState {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
extern ThreadState* current_thread;

// Not instrumented: the race flavour must not take this read of the runtime's own state for a
// kernel's access to (static) shared memory.
__attribute__((no_sanitize_thread)) inline ThreadState& current() {
  if (!current_thread) __builtin_trap();  // a kernel built-in used outside a kernel
  return *current_thread;
}

// Kernel-side operations.
void syncthreads(Site site);
void yield(Site site);  // a scheduling point: atomics and fences
enum class ShuffleKind : int { kIndex, kUp, kDown, kXor };
// Exchanges `bytes` (4 or 8) bytes: `value` in, the source lane's value out.
void shuffle(Site site, ShuffleKind kind, unsigned mask, void* value, int bytes, int operand,
             int width);
// D = A B + C of one m16n8k16 tile, fragments per lane as the PTX ISA defines them.
void mma_m16n8k16(bool f16, float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                  uint32_t b0, uint32_t b1);
void* dynamic_shared();
void wait_for_previous_grid();  // griddepcontrol.wait: marks the running thread as having waited
[[noreturn]] void trap(Site site);

// cp.async (kernels/async_copy.cuh): the running thread's issued copies, queued here until a wait
// completes them. The copy itself (and the poisoning of its destination at issue) is done by the
// kernel-side shim in prelude.h, so that the checkers see its loads and stores.
struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes;      // 4, 8 or 16
  int src_bytes;  // bytes read from src, the rest zero-filled
};
// Queues a copy in the thread's open group; false (after a report) for a size or alignment the
// instruction does not allow.
bool async_copy_issue(Site site, const AsyncCopy& copy);
void async_copy_commit();  // closes the open group
// Moves to `out` (up to `capacity`) the copies of every committed group but the `pending` most
// recent ones; returns how many.
int async_copy_take(int pending, AsyncCopy* out, int capacity);

// Host side: the runtime calls the launchers make.
cudaError_t func_set_attribute(const void* func, cudaFuncAttribute attribute, int value);
cudaError_t occupancy(int* blocks, const void* func, int threads, size_t dynamic_shared);
cudaError_t device_attribute(int* value, cudaDeviceAttr attribute, int device);
cudaError_t get_last_error();
cudaError_t peek_last_error();
const char* error_string(cudaError_t error);
std::string last_error_message();  // what the last failed call or launch reported

// Launch: runs `body(block)` for every block; body runs the kernel in the current fiber.
// dependent: launched to overlap the kernel before it (DSPARK_LAUNCH_DEPENDENT); blocks still run
// after that kernel's, and every thread must reach wait_for_previous_grid() before it exits.
// fields: the parameter struct's plan fields (prelude.h plan_fields), kept in the launch record.
using KernelBody = void (*)(void* closure);
void launch(const char* name, const void* func, dim3 grid, dim3 block, size_t shared,
            KernelBody body, void* closure, bool dependent = false,
            const std::string& fields = "");
void register_launch_bounds(const char* name, int max_threads);
// Called once per launched kernel when the library loads (prelude.h Launcher::registered).
void register_kernel(const char* pretty_name, const void* func);
// Every registered kernel's instantiation, one a line.
std::string kernel_names();

// Per-kernel resources of a compiled binary ("instantiation\tregisters\tshared" lines; shared as
// cuobjdump reports it: static shared memory plus the 1 KB reserved per block). With them the
// occupancy query applies the register and shared-memory limits of the binary's kernels; without
// them (the default), threads, block slots and dynamic shared memory only. Each distinct table
// makes the emulated device one of its own (device_ordinal() past the launchers' per-device
// caches), so no plan reuses an answer computed without it. Returns an error message, empty when
// every line named a registered kernel (the table is then in force; otherwise nothing changed).
std::string set_kernel_resources(const std::string& table);
// The occupancy query's answer for a registered instantiation (-1 when it is not registered).
int occupancy_of_kernel(const std::string& kernel, int threads, size_t dynamic_shared);

// Plan-only mode: launches are checked and recorded but no block runs (the glue and launchers
// still run in full, so a plan at sizes too large to emulate costs only the host work).
void set_plan_only(bool on);

// What ran, for coverage reports: "kernel<instantiation>" -> launches.
std::string launch_log();
// Every launch since the last clear, in order: one JSON object a line with the instantiation,
// grid, block, dynamic shared memory, whether it was dependent, its plan fields and whether its
// blocks ran (false in plan-only mode).
std::string launch_records();
void clear_launch_log();

// Accesses reported by the race flavour's instrumentation (see race.cpp), and bounds reports.
void report(const std::string& kind, const std::string& detail);

}  // namespace dspark_sim
