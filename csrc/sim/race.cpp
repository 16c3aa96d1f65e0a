// The race flavour's checker. The kernel translation units are compiled with g++'s
// -fsanitize=thread instrumentation, which calls __tsan_read4(addr), __tsan_write8(addr),
// __tsan_atomic64_fetch_add(...) ... around every memory access; instead of ThreadSanitizer's
// runtime (which neither knows fibers as CUDA threads nor barriers as CUDA defines them) this file
// implements those entry points, for accesses made by an emulated thread:
//   - a data race is two accesses to the same byte by different threads of a block between two
//     consecutive __syncthreads, at least one a write and not both atomic (CUDA Programming Guide,
//     "Memory Consistency": __syncthreads orders the block's accesses; warp shuffles do not);
//   - a read of shared memory (static __shared__ storage, or the dynamic shared buffer) that no
//     earlier write of the same block initialised is reported: shared memory starts undefined.
// Accesses to the fiber stacks (thread-private locals) are not tracked. Blocks run one at a time,
// so races between blocks (ordered on hardware by fences and atomics) are out of scope.
#include <dlfcn.h>
#include <link.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "race.h"
#include "runtime.h"

namespace dspark_sim::race {
namespace {

struct Cell {             // shadow of 8 bytes of memory
  uintptr_t granule = 0;  // address / 8 + 1; 0: empty slot
  uint32_t epoch = 0;     // the barrier interval of writer/reader
  uint8_t initialised = 0;  // bytes written earlier in this block
  uint8_t write_plain = 0, read_plain = 0;  // the recorded access was not atomic
  uint16_t writer[8] = {}, reader[8] = {};  // tid + 1; reader kMany: several threads
  uintptr_t write_pc = 0, read_pc = 0;
};
constexpr uint16_t kMany = 0xFFFF;

std::vector<Cell> g_table(1 << 16);
std::vector<size_t> g_used;
int g_tid = -1;
uint32_t g_epoch = 1;
const char* g_stack_begin = nullptr;
const char* g_stack_end = nullptr;
const char* g_dynamic_begin = nullptr;
const char* g_dynamic_end = nullptr;
std::vector<std::pair<const char*, const char*>> g_static_shared;  // this library's writable data
int g_reports = 0;

void grow();

Cell& cell(uintptr_t granule) {
  if (g_used.size() * 2 > g_table.size()) grow();
  const size_t mask = g_table.size() - 1;
  size_t i = (granule * 0x9E3779B97F4A7C15ull >> 17) & mask;
  while (g_table[i].granule != 0 && g_table[i].granule != granule) i = (i + 1) & mask;
  Cell& c = g_table[i];
  if (c.granule == 0) {
    c.granule = granule;
    g_used.push_back(i);
  }
  return c;
}

void grow() {
  std::vector<Cell> old;
  old.swap(g_table);
  g_table.assign(old.size() * 2, Cell{});
  g_used.clear();
  for (const Cell& c : old) {
    if (c.granule != 0) cell(c.granule) = c;
  }
}

bool is_shared(const char* p) {
  if (p >= g_dynamic_begin && p < g_dynamic_end) return true;
  for (const auto& [begin, end] : g_static_shared) {
    if (p >= begin && p < end) return true;
  }
  return false;
}

std::string symbolize(uintptr_t pc) {
  Dl_info info{};
  if (!pc || !dladdr(reinterpret_cast<void*>(pc), &info) || !info.dli_fname) return "?";
  static std::map<uintptr_t, std::string> cache;
  const auto found = cache.find(pc);
  if (found != cache.end()) return found->second;
  const uintptr_t offset = pc - reinterpret_cast<uintptr_t>(info.dli_fbase) - 1;
  std::ostringstream cmd;
  cmd << "addr2line -C -e '" << info.dli_fname << "' 0x" << std::hex << offset << " 2>/dev/null";
  std::string line = "?";
  if (FILE* pipe = popen(cmd.str().c_str(), "r")) {
    char buffer[512];
    if (fgets(buffer, sizeof(buffer), pipe)) {
      line = buffer;
      while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
      const auto slash = line.rfind('/');
      if (slash != std::string::npos) line = line.substr(slash + 1);
      const auto space = line.find(' ');
      if (space != std::string::npos) line = line.substr(0, space);
    }
    pclose(pipe);
  }
  return cache[pc] = line;
}

std::string who(uint16_t id) {
  if (id == kMany) return "several threads";
  std::ostringstream out;
  out << "thread " << id - 1;
  return out.str();
}

void race_report(const char* what, const char* p, int bytes, uintptr_t pc, uint16_t other,
                 uintptr_t other_pc, const char* other_what) {
  if (++g_reports > 8) return;
  std::ostringstream out;
  out << "thread " << g_tid << " " << what << " of " << bytes << " bytes at "
      << (is_shared(p) ? "shared " : "global ") << static_cast<const void*>(p) << " ("
      << symbolize(pc) << ") and " << who(other) << " " << other_what << " it ("
      << symbolize(other_pc) << ") with no __syncthreads between";
  report("data race", out.str());
}

void access(const void* address, size_t size, bool write, bool atomic, uintptr_t pc) {
  if (g_tid < 0 || size == 0) return;
  const char* p = static_cast<const char*>(address);
  if (p >= g_stack_begin && p < g_stack_end) return;
  const uint16_t me = static_cast<uint16_t>(g_tid + 1);
  const bool shared = is_shared(p);
  bool reported = false;
  for (size_t done = 0; done < size;) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p + done);
    Cell& c = cell(a / 8 + 1);
    if (c.epoch != g_epoch) {
      c.epoch = g_epoch;
      std::memset(c.writer, 0, sizeof(c.writer));
      std::memset(c.reader, 0, sizeof(c.reader));
      c.write_plain = c.read_plain = 0;
    }
    const size_t first = a % 8, count = std::min<size_t>(8 - first, size - done);
    for (size_t k = first; k < first + count; ++k) {
      const uint8_t bit = static_cast<uint8_t>(1u << k);
      const uint16_t w = c.writer[k], r = c.reader[k];
      if (!reported && w != 0 && w != me && (!atomic || (c.write_plain & bit))) {
        race_report(write ? "writes" : "reads", p, static_cast<int>(size), pc, w, c.write_pc,
                    "writes");
        reported = true;
      }
      if (write) {
        if (!reported && r != 0 && r != me && (!atomic || (c.read_plain & bit))) {
          race_report("writes", p, static_cast<int>(size), pc, r, c.read_pc, "reads");
          reported = true;
        }
        c.writer[k] = me;
        c.write_plain = atomic ? (c.write_plain & ~bit) : (c.write_plain | bit);
        c.initialised |= bit;
      } else {
        if (!reported && shared && !(c.initialised & bit)) {
          if (++g_reports <= 8) {
            std::ostringstream out;
            out << "thread " << g_tid << " reads " << size << " bytes of shared memory at "
                << static_cast<const void*>(p) << " (" << symbolize(pc)
                << ") that no thread of this block wrote before";
            report("uninitialised shared memory", out.str());
          }
          reported = true;
        }
        c.reader[k] = r == 0 || r == me ? me : kMany;
        if (!atomic) c.read_plain |= bit;
      }
    }
    if (write) c.write_pc = pc;
    else c.read_pc = pc;
    done += count;
  }
}

int find_writable_segments(dl_phdr_info* info, size_t, void* self) {
  Dl_info mine{};
  dladdr(self, &mine);
  if (reinterpret_cast<void*>(info->dlpi_addr) != mine.dli_fbase) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_LOAD && (ph.p_flags & PF_W)) {
      const char* begin = reinterpret_cast<const char*>(info->dlpi_addr + ph.p_vaddr);
      g_static_shared.emplace_back(begin, begin + ph.p_memsz);
    }
  }
  return 1;
}

}  // namespace

void set_stack_range(const void* begin, const void* end) {
  g_stack_begin = static_cast<const char*>(begin);
  g_stack_end = static_cast<const char*>(end);
  if (g_static_shared.empty()) {
    // Kernels have no writable statics but their __shared__ variables (prelude.h), so an
    // instrumented access into this library's writable segments is a shared-memory access.
    dl_iterate_phdr(find_writable_segments, reinterpret_cast<void*>(&set_stack_range));
  }
}

void switch_to(int tid) { g_tid = tid; }
void barrier() { ++g_epoch; }

void begin_block(const void* dynamic_shared, size_t bytes) {
  for (const size_t i : g_used) g_table[i] = Cell{};
  g_used.clear();
  g_dynamic_begin = static_cast<const char*>(dynamic_shared);
  g_dynamic_end = g_dynamic_begin + (dynamic_shared ? bytes : 0);
  ++g_epoch;
  g_reports = 0;
}

void end_block() {
  g_tid = -1;
  g_dynamic_begin = g_dynamic_end = nullptr;
}

}  // namespace dspark_sim::race

// ------------------------------------------------------------------------------------------------
// The instrumentation's entry points (g++ -fsanitize=thread, the ThreadSanitizer ABI).

using dspark_sim::race::access;
#define DSPARK_PC reinterpret_cast<uintptr_t>(__builtin_return_address(0))

extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
void __tsan_read_range(void* p, unsigned long n) { access(p, n, false, false, DSPARK_PC); }
void __tsan_write_range(void* p, unsigned long n) { access(p, n, true, false, DSPARK_PC); }

#define DSPARK_PLAIN(n)                                                                           \
  void __tsan_read##n(void* p) { access(p, n, false, false, DSPARK_PC); }                         \
  void __tsan_write##n(void* p) { access(p, n, true, false, DSPARK_PC); }                         \
  void __tsan_unaligned_read##n(void* p) { access(p, n, false, false, DSPARK_PC); }               \
  void __tsan_unaligned_write##n(void* p) { access(p, n, true, false, DSPARK_PC); }               \
  void __tsan_volatile_read##n(void* p) { access(p, n, false, false, DSPARK_PC); }                \
  void __tsan_volatile_write##n(void* p) { access(p, n, true, false, DSPARK_PC); }                \
  void __tsan_unaligned_volatile_read##n(void* p) { access(p, n, false, false, DSPARK_PC); }      \
  void __tsan_unaligned_volatile_write##n(void* p) { access(p, n, true, false, DSPARK_PC); }
DSPARK_PLAIN(1)
DSPARK_PLAIN(2)
DSPARK_PLAIN(4)
DSPARK_PLAIN(8)
DSPARK_PLAIN(16)

#define DSPARK_ATOMIC(n, T)                                                                       \
  T __tsan_atomic##n##_load(const volatile T* a, int) {                                           \
    access(const_cast<const T*>(a), sizeof(T), false, true, DSPARK_PC);                           \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                  \
  }                                                                                               \
  void __tsan_atomic##n##_store(volatile T* a, T v, int) {                                        \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                     \
  }                                                                                               \
  T __tsan_atomic##n##_exchange(volatile T* a, T v, int) {                                        \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                               \
  T __tsan_atomic##n##_fetch_add(volatile T* a, T v, int) {                                       \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                               \
  T __tsan_atomic##n##_fetch_sub(volatile T* a, T v, int) {                                       \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                               \
  T __tsan_atomic##n##_fetch_and(volatile T* a, T v, int) {                                       \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                               \
  T __tsan_atomic##n##_fetch_or(volatile T* a, T v, int) {                                        \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                               \
  T __tsan_atomic##n##_fetch_xor(volatile T* a, T v, int) {                                       \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                               \
  T __tsan_atomic##n##_fetch_nand(volatile T* a, T v, int) {                                      \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                               \
  int __tsan_atomic##n##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {            \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
  }                                                                                               \
  int __tsan_atomic##n##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {              \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
  }                                                                                               \
  T __tsan_atomic##n##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                  \
    access(const_cast<T*>(a), sizeof(T), true, true, DSPARK_PC);                                  \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);             \
    return c;                                                                                     \
  }
DSPARK_ATOMIC(8, int8_t)
DSPARK_ATOMIC(16, int16_t)
DSPARK_ATOMIC(32, int32_t)
DSPARK_ATOMIC(64, int64_t)

void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) {}
}
