// The SIMT emulator (see runtime.h for the model). Never compiled with the race instrumentation:
// in the race flavour this file also implements the instrumentation's callbacks (race.h).
#include "runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(DSPARK_SIM_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#include "race.h"

namespace dspark_sim {

void release_barrier();

// ------------------------------------------------------------------------------------------------
// Devices.

namespace {

const DeviceSpec kDevices[] = {
    // name, cc, SMs, threads/SM, blocks/SM, shared/SM, opt-in per block
    {"h200", 9, 0, 132, 2048, 32, 228 * 1024, 227 * 1024},
    {"a100", 8, 0, 108, 2048, 32, 164 * 1024, 163 * 1024},
    {"l4", 8, 9, 58, 1536, 24, 100 * 1024, 99 * 1024},
};

const DeviceSpec* g_device = &kDevices[0];

// xorshift64*: the emulator's only source of scheduling randomness.
struct Rng {
  uint64_t state = 0x9E3779B97F4A7C15ull;
  uint64_t next() {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545F4914F6CDD1Dull;
  }
  uint32_t below(uint32_t n) { return static_cast<uint32_t>((next() >> 32) % n); }
};
Rng g_rng;
std::string g_plant;

struct LastError {
  cudaError_t code = cudaSuccess;
  std::string message;
};
LastError g_error;
std::string g_last_message;

void set_error(cudaError_t code, const std::string& message) {
  if (g_error.code == cudaSuccess) g_error = {code, message};
  g_last_message = message;
}

std::map<std::pair<std::string, const void*>, int> g_max_dynamic_shared;  // per device, kernel
std::map<std::string, int> g_launch_bounds;
std::map<std::string, int> g_launch_log;
std::vector<std::string> g_launch_records;  // launch_records(): one JSON object each
bool g_plan_only = false;
// address -> instantiation (register_kernel): filled by other units' static initialisers, so
// constructed on first use.
std::map<const void*, std::string>& g_kernels() {
  static std::map<const void*, std::string> kernels;
  return kernels;
}
struct Resources {
  int registers;
  int shared;  // static + the 1 KB reserved per block
};
std::map<std::string, Resources> g_resources;  // instantiation -> set_kernel_resources

// "const char* ...kernel_name() [with auto Kernel = &ns::kernels::name<args>]" -> "name<args>"
// (namespace kernels:: dropped; other namespaces kept).
std::string instantiation(const std::string& pretty) {
  const auto at = pretty.find("Kernel = ");
  std::string full = at == std::string::npos ? pretty : pretty.substr(at + 9);
  if (!full.empty() && full.back() == ']') full.pop_back();
  if (!full.empty() && full[0] == '&') full.erase(0, 1);
  const auto ns = full.find("kernels::");
  return ns == std::string::npos ? full : full.substr(ns + 9);
}

// "ns::name<args>" -> "name": the key of the __launch_bounds__ registry.
std::string base_name(const std::string& kernel) {
  const std::string name = kernel.substr(0, kernel.find('<'));
  const auto colon = name.rfind("::");
  return colon == std::string::npos ? name : name.substr(colon + 2);
}

}  // namespace

const DeviceSpec& device() { return *g_device; }
// With a binary's kernel resources set, the emulated device answers occupancy queries as that
// binary's GPU: a device of its own, whose ordinal (past common/device_cache.h's kMaxDevices,
// one per distinct resource table) keeps the launchers' per-device caches from answering with
// what they computed without those resources, or with another table's.
static constexpr int kDeviceCount = static_cast<int>(sizeof(kDevices) / sizeof(kDevices[0]));
static constexpr int kResourceOrdinals = 64;
// Ordinals stay within c10::DeviceIndex (int8_t).
static constexpr int kResourceTables = (127 - kResourceOrdinals) / kDeviceCount;
static std::vector<std::string> g_resource_tables;  // distinct tables set so far
static int g_resource_table = -1;                 // the current one's index; -1: none

int device_ordinal() {
  const int index = static_cast<int>(g_device - kDevices);
  return g_resource_table < 0 ? index
                              : kResourceOrdinals + g_resource_table * kDeviceCount + index;
}

bool set_device(const std::string& name) {
  for (const auto& d : kDevices) {
    if (name == d.name) {
      g_device = &d;
      return true;
    }
  }
  return false;
}

void set_seed(uint64_t seed) { g_rng.state = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull; }
void set_plant(const std::string& plant) { g_plant = plant; }
bool polls_see_launch_start() { return g_plant == "polls_see_launch_start"; }
void register_launch_bounds(const char* name, int max_threads) { g_launch_bounds[name] = max_threads; }

std::string launch_log() {
  std::ostringstream out;
  for (const auto& [name, count] : g_launch_log) out << name << "\t" << count << "\n";
  return out.str();
}
std::string launch_records() {
  std::string out;
  for (const auto& r : g_launch_records) out += r + "\n";
  return out;
}
void clear_launch_log() {
  g_launch_log.clear();
  g_launch_records.clear();
}
void set_plan_only(bool on) { g_plan_only = on; }

void register_kernel(const char* pretty_name, const void* func) {
  g_kernels()[func] = instantiation(pretty_name);
}

std::string kernel_names() {
  std::vector<std::string> names;
  for (const auto& [func, name] : g_kernels()) names.push_back(name);
  std::sort(names.begin(), names.end());
  std::string out;
  for (const auto& n : names) out += n + "\n";
  return out;
}

std::string set_kernel_resources(const std::string& table) {
  std::map<std::string, Resources> parsed;
  std::set<std::string> known;
  for (const auto& [func, name] : g_kernels()) known.insert(name);
  std::istringstream in(table);
  std::string line, problems;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto tab2 = line.rfind('\t');
    const auto tab1 = tab2 == std::string::npos || tab2 == 0 ? std::string::npos
                                                              : line.rfind('\t', tab2 - 1);
    if (tab1 == std::string::npos) {
      problems += "not 'instantiation<TAB>registers<TAB>shared': '" + line + "'; ";
      continue;
    }
    const std::string name = line.substr(0, tab1);
    if (!known.count(name)) {
      problems += "no registered kernel '" + name + "'; ";
      continue;
    }
    parsed[name] = {std::atoi(line.substr(tab1 + 1, tab2 - tab1 - 1).c_str()),
                    std::atoi(line.substr(tab2 + 1).c_str())};
  }
  if (!problems.empty()) return problems;
  std::ostringstream canonical;
  for (const auto& [name, r] : parsed) {
    canonical << name << "\t" << r.registers << "\t" << r.shared << "\n";
  }
  int index = -1;
  if (!parsed.empty()) {
    const auto found =
        std::find(g_resource_tables.begin(), g_resource_tables.end(), canonical.str());
    if (found == g_resource_tables.end()) {
      if (static_cast<int>(g_resource_tables.size()) == kResourceTables) {
        return "more than " + std::to_string(kResourceTables) +
               " distinct resource tables in one process (each is an emulated device)";
      }
      g_resource_tables.push_back(canonical.str());
      index = static_cast<int>(g_resource_tables.size()) - 1;
    } else {
      index = static_cast<int>(found - g_resource_tables.begin());
    }
  }
  g_resources = std::move(parsed);
  g_resource_table = index;
  return problems;
}

// ------------------------------------------------------------------------------------------------
// Fibers: one per thread of the running block, on stacks from one pool. The switch saves the
// callee-saved registers and the floating-point control words (System V x86-64); other targets use
// ucontext.

#if defined(__x86_64__)
extern "C" void dspark_sim_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl dspark_sim_switch
  .hidden dspark_sim_switch
  .type dspark_sim_switch,@function
dspark_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dspark_sim_switch,.-dspark_sim_switch
)");
#endif

namespace {

#if defined(DSPARK_SIM_ASAN)
constexpr size_t kStackBytes = 512 * 1024;
#else
constexpr size_t kStackBytes = 256 * 1024;
#endif
constexpr int kMaxThreads = 1024;

enum class Wait { kReady, kBarrier, kCollective, kExited };

struct Fiber {
  char* stack = nullptr;  // lowest address (a guard page below kStackBytes)
  void* sp = nullptr;     // saved stack pointer while switched out
#if !defined(__x86_64__)
  ucontext_t context;
#endif
  ThreadState state;
  int tid = 0;
  Wait wait = Wait::kReady;
  Site site{};  // where it waits
  // cp.async: issued copies not yet completed, each with its group (groups below `committed`
  // are committed; the open group is `committed`) and where it was issued.
  struct PendingCopy {
    AsyncCopy copy;
    int group;
    Site site;
  };
  std::vector<PendingCopy> copies;
  int committed = 0;
  bool waited_for_previous_grid = false;  // griddepcontrol.wait reached
};

struct Collective {
  bool active = false;
  bool mma = false;
  ShuffleKind kind{};
  unsigned mask = 0;
  int bytes = 0, width = 32;
  Site site{};
  unsigned arrived = 0;
  void* values[32] = {};  // each lane's value (shuffle) or accumulator (mma)
  int operands[32] = {};
  uint32_t frags[32][6] = {};  // mma: a0..a3, b0, b1
};

struct BlockRun {
  std::vector<Fiber*> fibers;
  std::vector<int> ready;
  int threads = 0, live = 0, exited = 0, at_barrier = 0;
  std::vector<Collective> warps;
  bool fatal = false;
  std::vector<std::string> reports;
  KernelBody body = nullptr;
  void* closure = nullptr;
  void* dynamic_shared = nullptr;
  size_t dynamic_bytes = 0;
  std::string kernel;
  bool dependent = false;  // launched to overlap the kernel before it (DSPARK_LAUNCH_DEPENDENT)
};

char* g_stack_pool = nullptr;
std::vector<Fiber> g_fibers(kMaxThreads);
void* g_scheduler_sp = nullptr;
#if !defined(__x86_64__)
ucontext_t g_scheduler_context;
#endif
Fiber* g_running = nullptr;
BlockRun* g_block = nullptr;

#if defined(DSPARK_SIM_ASAN)
void* g_scheduler_fake_stack = nullptr;
const void* g_scheduler_stack_bottom = nullptr;
size_t g_scheduler_stack_size = 0;
#endif

void init_pool() {
  if (g_stack_pool) return;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t per = kStackBytes + page;
  void* pool = mmap(nullptr, per * kMaxThreads, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (pool == MAP_FAILED) {
    std::fprintf(stderr, "dspark_sim: cannot map fiber stacks\n");
    std::abort();
  }
  g_stack_pool = static_cast<char*>(pool);
  for (int i = 0; i < kMaxThreads; ++i) {
    char* base = g_stack_pool + i * per;
    mprotect(base, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
    g_fibers[i].stack = base + page;
  }
  race::set_stack_range(g_stack_pool, g_stack_pool + per * kMaxThreads);
}

std::string where(const Site& s) {
  const char* file = s.file ? s.file : "?";
  const char* slash = std::strrchr(file, '/');
  std::ostringstream out;
  out << (slash ? slash + 1 : file) << ":" << s.line;
  return out.str();
}

std::string thread_name(const Fiber& f) {
  std::ostringstream out;
  out << "thread (" << f.state.thread_idx.x << "," << f.state.thread_idx.y << ","
      << f.state.thread_idx.z << ") of block (" << f.state.block_idx.x << ","
      << f.state.block_idx.y << "," << f.state.block_idx.z << ")";
  return out.str();
}

void add_report(const std::string& kind, const std::string& detail, bool fatal) {
  if (!g_block) {
    // A sanitizer report from host code (the glue): the next runtime call returns it.
    set_error(cudaErrorUnknown, "dspark_sim: " + kind + " in host code: " + detail);
    return;
  }
  if (g_block->reports.size() < 16) {
    g_block->reports.push_back(kind + " in " + g_block->kernel + ": " + detail);
  }
  if (fatal) g_block->fatal = true;
}

// A launch's dynamic shared memory, exactly `bytes` long. In the bounds flavour it sits between
// two poisoned guard bands as long as itself (at least 256 bytes): an index up to a whole buffer
// before or past it is reported, and, since the launch goes on after a report, the stray write
// lands in the guard instead of corrupting a neighbouring heap block.
class DynamicShared {
 public:
  explicit DynamicShared(size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
#if defined(DSPARK_SIM_ASAN)
    guard_ = (std::max<size_t>(bytes, 256) + 63) / 64 * 64;
#endif
    storage_.reset(new unsigned char[guard_ + bytes + guard_]);
#if defined(DSPARK_SIM_ASAN)
    __asan_poison_memory_region(storage_.get(), guard_);
    __asan_poison_memory_region(data() + bytes, guard_);
#endif
  }
  DynamicShared(const DynamicShared&) = delete;
  DynamicShared& operator=(const DynamicShared&) = delete;
  ~DynamicShared() {
#if defined(DSPARK_SIM_ASAN)
    if (storage_) __asan_unpoison_memory_region(storage_.get(), guard_ + bytes_ + guard_);
#endif
  }
  unsigned char* data() { return storage_ ? storage_.get() + guard_ : nullptr; }

 private:
  size_t bytes_;
  size_t guard_ = 0;
  std::unique_ptr<unsigned char[]> storage_;
};

// Switches from the running fiber back to the scheduler.
void to_scheduler() {
  Fiber* self = g_running;
#if defined(DSPARK_SIM_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(self->wait == Wait::kExited ? nullptr : &fake,
                                 g_scheduler_stack_bottom, g_scheduler_stack_size);
#endif
  race::switch_to(-1);
#if defined(__x86_64__)
  dspark_sim_switch(&self->sp, g_scheduler_sp);
#else
  swapcontext(&self->context, &g_scheduler_context);
#endif
#if defined(DSPARK_SIM_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void fiber_main() {
#if defined(DSPARK_SIM_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &g_scheduler_stack_bottom, &g_scheduler_stack_size);
#endif
  Fiber* self = g_running;
  current_thread = &self->state;
  g_block->body(g_block->closure);
  // The thread returned from the kernel.
  if (!self->copies.empty()) {
    add_report("cp.async", thread_name(*self) + " exited with " +
                               std::to_string(self->copies.size()) +
                               " asynchronous copies never waited for (the first issued at " +
                               where(self->copies.front().site) + ")",
               true);
    self->copies.clear();
  }
  if (g_block->dependent && !self->waited_for_previous_grid) {
    // The kernel before may still be running: its writes are not visible yet, and this grid may
    // complete before it, releasing the stream's next kernel early.
    add_report("dependent launch", thread_name(*self) +
                                       " exited without wait_for_previous_grid() in a kernel "
                                       "launched with DSPARK_LAUNCH_DEPENDENT",
               true);
  }
  self->wait = Wait::kExited;
  g_block->live -= 1;
  g_block->exited += 1;
  Collective& c = g_block->warps[self->tid / 32];
  if (c.active && (c.mask >> (self->tid % 32) & 1u) && !(c.arrived >> (self->tid % 32) & 1u)) {
    add_report("shuffle", thread_name(*self) + " exited while named in the mask of the " +
                              std::string(c.mma ? "mma.sync" : "warp shuffle") + " at " +
                              where(c.site),
               true);
  }
  if (g_block->at_barrier > 0 && g_block->at_barrier == g_block->live) release_barrier();
  to_scheduler();
  __builtin_trap();  // an exited fiber is never resumed
}

#if defined(__x86_64__)
extern "C" void dspark_sim_fiber_entry() { fiber_main(); }
#endif

void start_fiber(Fiber& f) {
#if defined(DSPARK_SIM_ASAN)
  __asan_unpoison_memory_region(f.stack, kStackBytes);  // frames an aborted block left behind
#endif
#if defined(__x86_64__)
  auto* top = reinterpret_cast<uint64_t*>(
      (reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t{15}));
  uint64_t* sp = top;
  *--sp = 0;                                                          // fake return address
  *--sp = reinterpret_cast<uint64_t>(&dspark_sim_fiber_entry);        // popped by ret
  for (int i = 0; i < 6; ++i) *--sp = 0;                              // rbp rbx r12 r13 r14 r15
  --sp;
  uint32_t control[2];
  asm volatile("stmxcsr %0" : "=m"(control[0]));
  asm volatile("fnstcw %0" : "=m"(control[1]));
  std::memcpy(sp, control, 8);
  f.sp = sp;
#else
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = nullptr;
  makecontext(&f.context, fiber_main, 0);
#endif
}

void resume(Fiber& f) {
  g_running = &f;
  current_thread = &f.state;
  race::switch_to(f.tid);
#if defined(DSPARK_SIM_ASAN)
  __sanitizer_start_switch_fiber(&g_scheduler_fake_stack, f.stack, kStackBytes);
#endif
#if defined(__x86_64__)
  dspark_sim_switch(&g_scheduler_sp, f.sp);
#else
  swapcontext(&g_scheduler_context, &f.context);
#endif
#if defined(DSPARK_SIM_ASAN)
  __sanitizer_finish_switch_fiber(g_scheduler_fake_stack, nullptr, nullptr);
#endif
  g_running = nullptr;
  current_thread = nullptr;
}

void make_ready(Fiber& f) {
  f.wait = Wait::kReady;
  g_block->ready.push_back(f.tid);
}

}  // namespace

ThreadState* current_thread = nullptr;

// ------------------------------------------------------------------------------------------------
// Barriers.

void release_barrier() {
  BlockRun& b = *g_block;
  Site first{};
  bool mixed = false, have = false;
  for (Fiber* f : b.fibers) {
    if (f->wait != Wait::kBarrier) continue;
    if (!have) first = f->site, have = true;
    else if (f->site.line != first.line || std::strcmp(f->site.file, first.file) != 0) mixed = true;
  }
  if (mixed) {
    std::ostringstream out;
    out << "threads wait at different __syncthreads:";
    int shown = 0;
    for (Fiber* f : b.fibers) {
      if (f->wait == Wait::kBarrier && shown < 4 &&
          (f->site.line != first.line || std::strcmp(f->site.file, first.file) != 0)) {
        out << " " << thread_name(*f) << " at " << where(f->site) << ";";
        ++shown;
      }
    }
    out << " others at " << where(first);
    add_report("barrier", out.str(), true);
  }
  if (b.exited > 0) {
    std::ostringstream out;
    out << "__syncthreads at " << where(first) << " reached after " << b.exited << " of "
        << b.threads << " threads exited (undefined behaviour: the barrier must be reached by "
        << "every thread of the block)";
    add_report("barrier", out.str(), true);
  }
  for (Fiber* f : b.fibers) {
    if (f->wait == Wait::kBarrier) make_ready(*f);
  }
  b.at_barrier = 0;
  race::barrier();
}

void syncthreads(Site site) {
  if (!g_running) trap(site);
  if (!g_plant.empty() && g_plant.rfind("drop_barrier:", 0) == 0) {
    const std::string want = g_plant.substr(13);
    if (where(site) == want) {
      yield(site);
      return;
    }
  }
  Fiber& f = *g_running;
  f.wait = Wait::kBarrier;
  f.site = site;
  g_block->at_barrier += 1;
  if (g_block->at_barrier == g_block->live) release_barrier();
  to_scheduler();
}

void yield(Site) {
  if (!g_running) return;
  make_ready(*g_running);
  to_scheduler();
}

[[noreturn]] void trap(Site site) {
  if (g_running) {
    add_report("trap", thread_name(*g_running) + " executed __trap() at " + where(site), true);
    g_running->wait = Wait::kCollective;  // never resumed
    to_scheduler();
  }
  std::fprintf(stderr, "dspark_sim: a kernel built-in was used outside a kernel at %s\n",
               where(site).c_str());
  std::abort();
}

void* dynamic_shared() {
  if (!g_block) __builtin_trap();
  return g_block->dynamic_shared;
}

// ------------------------------------------------------------------------------------------------
// Warp-collective operations.

namespace {

const char* kind_name(const Collective& c) {
  if (c.mma) return "mma.sync.m16n8k16";
  switch (c.kind) {
    case ShuffleKind::kIndex: return "__shfl_sync";
    case ShuffleKind::kUp: return "__shfl_up_sync";
    case ShuffleKind::kDown: return "__shfl_down_sync";
    default: return "__shfl_xor_sync";
  }
}

int warp_lanes(int warp) { return std::min(32, g_block->threads - warp * 32); }

float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exponent = (h >> 10) & 31u, mantissa = h & 1023u;
  float value;
  if (exponent == 0) value = std::ldexp(static_cast<float>(mantissa), -24);
  else if (exponent == 31) value = mantissa ? NAN : INFINITY;
  else value = std::ldexp(static_cast<float>(mantissa | 1024u), static_cast<int>(exponent) - 25);
  return sign ? -value : value;
}

float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// D = A B + C for the whole warp, from the fragments as PTX ISA "Matrix Fragments for
// mma.m16n8k16 with floating point type" lays them out (groupID = lane >> 2,
// threadID_in_group = lane % 4): A's four .b32 registers hold (row, col) pairs
// (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); B's two hold (k 2t..2t+1, n g) and
// (k 2t+8.., n g); C/D's four floats are (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1). Each
// register's lower-index element is its low 16 bits. Products are exact; the sum of the 16
// products and C is taken in float64 and rounded once (the hardware's order and intermediate
// precision are unspecified).
void complete_mma(Collective& c, bool f16) {
  float a[16][16], b[16][8], acc[16][8];
  const auto unpack = [&](uint32_t word, int half) {
    const uint16_t bits = static_cast<uint16_t>(half ? word >> 16 : word);
    return f16 ? half_to_float(bits) : bf16_to_float(bits);
  };
  const bool swap = g_plant == "mma_swap_a12";
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    uint32_t* r = c.frags[lane];
    const uint32_t a1 = swap ? r[2] : r[1], a2 = swap ? r[1] : r[2];
    for (int h = 0; h < 2; ++h) {
      a[g][2 * t + h] = unpack(r[0], h);
      a[g + 8][2 * t + h] = unpack(a1, h);
      a[g][2 * t + 8 + h] = unpack(a2, h);
      a[g + 8][2 * t + 8 + h] = unpack(r[3], h);
      b[2 * t + h][g] = unpack(r[4], h);
      b[2 * t + 8 + h][g] = unpack(r[5], h);
    }
    const float* in = static_cast<const float*>(c.values[lane]);
    acc[g][2 * t] = in[0];
    acc[g][2 * t + 1] = in[1];
    acc[g + 8][2 * t] = in[2];
    acc[g + 8][2 * t + 1] = in[3];
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    float* out = static_cast<float*>(c.values[lane]);
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int e = 0; e < 4; ++e) {
      double sum = acc[rows[e]][cols[e]];
      for (int k = 0; k < 16; ++k) sum += double{a[rows[e]][k]} * double{b[k][cols[e]]};
      out[e] = static_cast<float>(sum);
    }
  }
}

void complete_shuffle(Collective& c, int warp) {
  uint64_t in[32] = {};
  for (int lane = 0; lane < 32; ++lane) {
    if (c.mask >> lane & 1u) std::memcpy(&in[lane], c.values[lane], c.bytes);
  }
  const bool off_by_one = g_plant == "shuffle_off_by_one";
  for (int lane = 0; lane < 32; ++lane) {
    if (!(c.mask >> lane & 1u)) continue;
    const int segment = lane / c.width * c.width, op = c.operands[lane];
    int src = lane;
    switch (c.kind) {
      case ShuffleKind::kIndex: src = segment + (op & (c.width - 1)); break;
      case ShuffleKind::kUp: src = lane - op >= segment ? lane - op : lane; break;
      case ShuffleKind::kDown: src = lane + op < segment + c.width ? lane + op : lane; break;
      case ShuffleKind::kXor: src = (lane ^ op) < segment + c.width ? lane ^ op : lane; break;
    }
    if (off_by_one) src = segment + (src - segment + 1) % c.width;
    if (src < 0 || src >= 32 || !(c.mask >> src & 1u)) {
      std::ostringstream out;
      out << "lane " << lane << " of warp " << warp << " reads lane " << src
          << ", which is not in the mask 0x" << std::hex << c.mask << std::dec << " of "
          << kind_name(c) << " at " << where(c.site);
      add_report("shuffle", out.str(), true);
      continue;
    }
    std::memcpy(c.values[lane], &in[src], c.bytes);
  }
}

void arrive(Collective& c, int warp) {
  Fiber& f = *g_running;
  const int lane = f.tid % 32;
  c.arrived |= 1u << lane;
  f.wait = Wait::kCollective;
  f.site = c.site;
  if (c.arrived == c.mask) {
    if (c.mma) complete_mma(c, c.kind == ShuffleKind::kIndex);
    else complete_shuffle(c, warp);
    for (int l = 0; l < 32; ++l) {
      if (c.mask >> l & 1u) make_ready(*g_block->fibers[warp * 32 + l]);
    }
    c.active = false;
    c.arrived = 0;
  }
  to_scheduler();
}

// Joins (or opens) the warp's pending collective; false after a reported mismatch.
bool join(Collective& c, bool mma, ShuffleKind kind, unsigned mask, int bytes, int width,
          Site site) {
  Fiber& f = *g_running;
  const int warp = f.tid / 32, lane = f.tid % 32, lanes = warp_lanes(warp);
  std::ostringstream problem;
  if (!(mask >> lane & 1u)) {
    problem << thread_name(f) << " (lane " << lane << ") calls a warp-collective operation at "
            << where(site) << " with mask 0x" << std::hex << mask << " that does not name it";
  } else if (lanes < 32 && (mask >> lanes) != 0) {
    problem << "the mask 0x" << std::hex << mask << std::dec << " at " << where(site)
            << " names lanes past the " << lanes << " threads of warp " << warp;
  } else if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    problem << "width " << width << " at " << where(site) << " is not a power of two in [1, 32]";
  } else if (c.active && (c.mma != mma || c.kind != kind || c.mask != mask || c.bytes != bytes ||
                          c.width != width || c.site.line != site.line)) {
    problem << "lanes of warp " << warp << " reached different warp-collective operations: "
            << kind_name(c) << " (mask 0x" << std::hex << c.mask << std::dec << ") at "
            << where(c.site) << " and, from lane " << lane << ", one at " << where(site);
  }
  if (!problem.str().empty()) {
    add_report("shuffle", problem.str(), true);
    f.wait = Wait::kCollective;
    to_scheduler();
    return false;
  }
  if (!c.active) {
    c = Collective{};
    c.active = true, c.mma = mma, c.kind = kind, c.mask = mask, c.bytes = bytes, c.width = width;
    c.site = site;
  }
  return true;
}

}  // namespace

void shuffle(Site site, ShuffleKind kind, unsigned mask, void* value, int bytes, int operand,
             int width) {
  if (!g_running) trap(site);
  Fiber& f = *g_running;
  const int warp = f.tid / 32, lane = f.tid % 32;
  Collective& c = g_block->warps[warp];
  if (!join(c, false, kind, mask, bytes, width, site)) return;
  c.values[lane] = value;
  c.operands[lane] = operand;
  arrive(c, warp);
}

void mma_m16n8k16(bool f16, float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                  uint32_t b0, uint32_t b1) {
  const Site site{"mma.sync", 0};
  if (!g_running) trap(site);
  Fiber& f = *g_running;
  const int warp = f.tid / 32, lane = f.tid % 32;
  Collective& c = g_block->warps[warp];
  // .aligned: every lane of a full warp executes the same mma.sync.
  if (!join(c, true, f16 ? ShuffleKind::kIndex : ShuffleKind::kXor, 0xffffffffu, 16, 32, site)) {
    return;
  }
  c.values[lane] = acc;
  const uint32_t regs[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(c.frags[lane], regs, sizeof(regs));
  arrive(c, warp);
}

// ------------------------------------------------------------------------------------------------
// Runtime calls.

const char* error_string(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    default: return "unknown error";
  }
}

cudaError_t get_last_error() {
  const cudaError_t code = g_error.code;
  g_error = {};
  return code;
}

cudaError_t peek_last_error() { return g_error.code; }

std::string last_error_message() { return g_last_message; }

cudaError_t func_set_attribute(const void* func, cudaFuncAttribute attribute, int value) {
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > g_device->shared_optin) {
      std::ostringstream out;
      out << "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, " << value
          << "): above the " << g_device->shared_optin << " bytes a block may opt in to on "
          << g_device->name;
      set_error(cudaErrorInvalidValue, out.str());
      g_error = {};  // the call returns the error; it is not sticky
      return cudaErrorInvalidValue;
    }
    g_max_dynamic_shared[{g_device->name, func}] = value;
  }
  return cudaSuccess;
}

namespace {

// Resident blocks per SM by the CUDA occupancy calculator's rules for the emulated device: warps,
// block slots, registers (allocated per warp in units of 256, from four equal partitions) and
// shared memory (static + dynamic + the 1 KB reserved per block, in units of 128 bytes). Without
// the kernel's resources: threads, block slots and dynamic shared memory only.
// bench/static/model.py occupancy() is the same rule (python_tests/test_static_plans.py).
int resident_blocks(const Resources* r, int threads, size_t dynamic_shared) {
  const int warps = (threads + 31) / 32;
  int n = std::min(g_device->max_threads_per_sm / 32 / warps, g_device->max_blocks_per_sm);
  const size_t reserved = r ? static_cast<size_t>(r->shared) : 1024;  // cuobjdump counts it
  const size_t per_block = dynamic_shared + reserved;
  if (r) {
    constexpr int kRegisterUnit = 256, kPartitions = 4;
    const int per_warp =
        (std::max(r->registers, 1) * 32 + kRegisterUnit - 1) / kRegisterUnit * kRegisterUnit;
    const int warps_by_registers =
        g_device->registers_per_sm / kPartitions / per_warp * kPartitions;
    n = std::min(n, warps_by_registers / warps);
    if (per_block > 0) {
      const size_t rounded = (per_block + 127) / 128 * 128;
      n = std::min<int>(n, static_cast<int>(g_device->shared_per_sm / rounded));
    }
  } else if (dynamic_shared > 0) {
    n = std::min<int>(n, static_cast<int>(g_device->shared_per_sm / per_block));
  }
  return n;
}

}  // namespace

cudaError_t occupancy(int* blocks, const void* func, int threads, size_t dynamic_shared) {
  if (threads <= 0 || threads > 1024) {
    *blocks = 0;
    return cudaErrorInvalidValue;
  }
  const Resources* r = nullptr;
  const auto kernel = g_kernels().find(func);
  if (kernel != g_kernels().end()) {
    const auto found = g_resources.find(kernel->second);
    if (found != g_resources.end()) r = &found->second;
  }
  *blocks = resident_blocks(r, threads, dynamic_shared);
  return cudaSuccess;
}

int occupancy_of_kernel(const std::string& kernel, int threads, size_t dynamic_shared) {
  for (const auto& [func, name] : g_kernels()) {
    if (name != kernel) continue;
    int n = 0;
    return occupancy(&n, func, threads, dynamic_shared) == cudaSuccess ? n : 0;
  }
  return -1;
}

cudaError_t device_attribute(int* value, cudaDeviceAttr attribute, int) {
  switch (attribute) {
    case cudaDevAttrMultiProcessorCount: *value = g_device->multiprocessors; break;
    case cudaDevAttrComputeCapabilityMajor: *value = g_device->major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = g_device->minor; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(g_device->shared_optin); break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(g_device->shared_default); break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = static_cast<int>(g_device->shared_per_sm); break;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    default:
      set_error(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute not emulated");
      return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// ------------------------------------------------------------------------------------------------
// cp.async: the queue of each thread's copies (PTX ISA "cp.async", "cp.async.wait_group").

bool async_copy_issue(Site site, const AsyncCopy& copy) {
  if (!g_running) trap(site);
  Fiber& f = *g_running;
  const auto misaligned = [&](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(copy.bytes) != 0;
  };
  std::ostringstream problem;
  if (copy.bytes != 4 && copy.bytes != 8 && copy.bytes != 16) {
    problem << "a copy of " << copy.bytes << " bytes (cp.async copies 4, 8 or 16)";
  } else if (copy.src_bytes < 0 || copy.src_bytes > copy.bytes) {
    problem << "a source size of " << copy.src_bytes << " for a copy of " << copy.bytes << " bytes";
  } else if (misaligned(copy.dst) || misaligned(copy.src)) {
    problem << "a " << copy.bytes << "-byte copy from " << copy.src << " to " << copy.dst
            << " not aligned to its size";
  } else if (g_block->dynamic_shared &&
             (static_cast<const unsigned char*>(copy.dst) <
                  static_cast<const unsigned char*>(g_block->dynamic_shared) ||
              static_cast<const unsigned char*>(copy.dst) + copy.bytes >
                  static_cast<const unsigned char*>(g_block->dynamic_shared) +
                      g_block->dynamic_bytes)) {
    problem << "a copy to " << copy.dst << ", outside the block's " << g_block->dynamic_bytes
            << " bytes of dynamic shared memory";
  }
  if (!problem.str().empty()) {
    add_report("cp.async", thread_name(f) + " issues " + problem.str() + " at " + where(site),
               true);
    return false;
  }
  f.copies.push_back({copy, f.committed, site});
  return true;
}

void wait_for_previous_grid() {
  if (!g_running) trap(Site{"griddepcontrol.wait", 0});
  g_running->waited_for_previous_grid = true;
}

void async_copy_commit() {
  if (!g_running) trap(Site{"cp.async.commit_group", 0});
  g_running->committed += 1;
}

int async_copy_take(int pending, AsyncCopy* out, int capacity) {
  if (!g_running) trap(Site{"cp.async.wait_group", 0});
  Fiber& f = *g_running;
  const int complete_below = f.committed - pending;  // groups older than the `pending` newest
  int n = 0;
  auto keep = f.copies.begin();
  for (auto it = f.copies.begin(); it != f.copies.end(); ++it) {
    if (it->group < complete_below && n < capacity) out[n++] = it->copy;
    else *keep++ = *it;
  }
  f.copies.erase(keep, f.copies.end());
  return n;
}

void report(const std::string& kind, const std::string& detail) { add_report(kind, detail, false); }

// ------------------------------------------------------------------------------------------------
// Launches.

namespace {

std::string dims(dim3 d) {
  std::ostringstream out;
  out << "(" << d.x << ", " << d.y << ", " << d.z << ")";
  return out.str();
}

// The configuration checks a launch makes before anything runs (CUDA Programming Guide, "Compute
// Capabilities" table; cudaFuncSetAttribute for dynamic shared memory past 48 KB).
std::string check_configuration(const std::string& kernel, const void* func, dim3 grid, dim3 block,
                                size_t shared) {
  std::ostringstream out;
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const auto bound = g_launch_bounds.find(base_name(kernel));
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 ||
      grid.z > 65535) {
    out << "grid " << dims(grid) << " outside (1..2^31-1, 1..65535, 1..65535)";
  } else if (block.x == 0 || block.y == 0 || block.z == 0 || block.x > 1024 || block.y > 1024 ||
             block.z > 64 || threads > 1024) {
    out << "block " << dims(block) << " outside the 1024 threads a block may have";
  } else if (bound != g_launch_bounds.end() && threads > static_cast<uint64_t>(bound->second)) {
    out << "block of " << threads << " threads exceeds __launch_bounds__(" << bound->second << ")";
  } else {
    const auto opted = g_max_dynamic_shared.find({g_device->name, func});
    const size_t limit = opted != g_max_dynamic_shared.end() ? static_cast<size_t>(opted->second)
                                                             : g_device->shared_default;
    if (shared > limit) {
      out << shared << " bytes of dynamic shared memory above the " << limit << " bytes "
          << (opted != g_max_dynamic_shared.end() ? "set by cudaFuncSetAttribute"
                                                  : "allowed without cudaFuncSetAttribute")
          << " on " << g_device->name;
    }
  }
  return out.str();
}

void run_block(BlockRun& b, dim3 block_idx, dim3 grid, dim3 block) {
  b.ready.clear();
  b.live = b.threads;
  b.exited = 0;
  b.at_barrier = 0;
  for (auto& w : b.warps) w = Collective{};
  if (b.dynamic_shared) std::memset(b.dynamic_shared, 0xFF, b.dynamic_bytes);  // poison
  race::begin_block(b.dynamic_shared, b.dynamic_bytes);
  for (int t = 0; t < b.threads; ++t) {
    Fiber& f = *b.fibers[t];
    f.tid = t;
    f.state.thread_idx = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
    f.state.block_idx = make_uint3(block_idx.x, block_idx.y, block_idx.z);
    f.state.block_dim = block;
    f.state.grid_dim = grid;
    f.wait = Wait::kReady;
    f.copies.clear();
    f.committed = 0;
    f.waited_for_previous_grid = false;
    start_fiber(f);
    b.ready.push_back(t);
  }
  while (!b.ready.empty() && !b.fatal) {
    const uint32_t pick = g_rng.below(static_cast<uint32_t>(b.ready.size()));
    const int t = b.ready[pick];
    b.ready[pick] = b.ready.back();
    b.ready.pop_back();
    resume(*b.fibers[t]);
  }
  if (!b.fatal && b.live > 0) {
    std::ostringstream out;
    out << "deadlock in block " << dims(block_idx) << ":";
    int shown = 0;
    for (Fiber* f : b.fibers) {
      if (f->wait == Wait::kExited || shown >= 6) continue;
      const Collective& c = b.warps[f->tid / 32];
      out << " " << thread_name(*f) << " waits at "
          << (f->wait == Wait::kBarrier ? "__syncthreads" : kind_name(c)) << " " << where(f->site)
          << ";";
      ++shown;
    }
    out << " (" << b.exited << " threads exited, " << b.at_barrier << " at a barrier)";
    add_report("barrier", out.str(), true);
  }
  race::end_block();
}

}  // namespace

void launch(const char* name, const void* func, dim3 grid, dim3 block, size_t shared,
            KernelBody body, void* closure, bool dependent, const std::string& fields) {
  const std::string kernel = instantiation(name);
  if (g_running) {
    set_error(cudaErrorLaunchFailure, "dspark_sim: a launch from inside a kernel (not emulated)");
    return;
  }
  const std::string bad = check_configuration(kernel, func, grid, block, shared);
  if (!bad.empty()) {
    set_error(cudaErrorInvalidConfiguration, "dspark_sim: launch of " + kernel + ": " + bad);
    return;
  }
  g_launch_log[kernel] += 1;
  {
    std::ostringstream record;  // names and fields hold no quote or backslash
    record << "{\"kernel\": \"" << kernel << "\", \"grid\": [" << grid.x << ", " << grid.y << ", "
           << grid.z << "], \"block\": [" << block.x << ", " << block.y << ", " << block.z
           << "], \"shared\": " << shared << ", \"dependent\": " << (dependent ? "true" : "false")
           << ", \"fields\": \"" << fields << "\", \"ran\": " << (g_plan_only ? "false" : "true")
           << "}";
    g_launch_records.push_back(record.str());
  }
  if (g_plan_only) return;
  init_pool();
  BlockRun b;
  b.kernel = kernel;
  b.threads = static_cast<int>(block.x * block.y * block.z);
  b.warps.resize((b.threads + 31) / 32);
  for (int t = 0; t < b.threads; ++t) b.fibers.push_back(&g_fibers[t]);
  b.body = body;
  b.closure = closure;
  b.dependent = dependent;
  DynamicShared dynamic(shared);
  b.dynamic_shared = dynamic.data();
  b.dynamic_bytes = shared;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> order(blocks);
  for (uint64_t i = 0; i < blocks; ++i) order[i] = i;
  for (uint64_t i = blocks; i > 1; --i) std::swap(order[i - 1], order[g_rng.next() % i]);
  g_block = &b;
  for (const uint64_t i : order) {
    const dim3 idx(static_cast<unsigned>(i % grid.x), static_cast<unsigned>((i / grid.x) % grid.y),
                   static_cast<unsigned>(i / (uint64_t{grid.x} * grid.y)));
    run_block(b, idx, grid, block);
    if (b.fatal) break;
  }
  g_block = nullptr;
  if (!b.reports.empty()) {
    std::ostringstream out;
    out << "dspark_sim: launch of " << kernel << " grid " << dims(grid) << " block " << dims(block)
        << " failed:";
    for (const auto& r : b.reports) out << "\n  " << r;
    set_error(cudaErrorLaunchFailure, out.str());
  }
}

}  // namespace dspark_sim

// ------------------------------------------------------------------------------------------------
// Reports from the sanitizers of the bounds flavour fail the launch that triggered them.

#if defined(DSPARK_SIM_ASAN)
extern "C" void __ubsan_get_current_report_data(const char** kind, const char** message,
                                                const char** file, unsigned* line,
                                                unsigned* column, char** address);
namespace {
void on_asan_report(const char* text) {
  std::string first(text ? text : "");
  const auto summary = first.find("SUMMARY:");
  dspark_sim::report("out of bounds (AddressSanitizer)",
                     summary == std::string::npos ? first.substr(0, 400) : first.substr(summary));
}
[[maybe_unused]] const bool g_asan_hook = [] {
  __asan_set_error_report_callback(on_asan_report);
  return true;
}();
}  // namespace

extern "C" __attribute__((visibility("default"))) void __ubsan_on_report() {
  const char *issue = nullptr, *message = nullptr, *file = nullptr;
  char* address = nullptr;
  unsigned line = 0, column = 0;
  __ubsan_get_current_report_data(&issue, &message, &file, &line, &column, &address);
  std::ostringstream out;
  out << (file ? file : "?") << ":" << line << ": " << (message ? message : "");
  dspark_sim::report("undefined behaviour (UBSan)", out.str());
}
#endif
