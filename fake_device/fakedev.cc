// fakedev: a fake accelerator for PaddlePaddle's custom-device runtime.
//
// Paddle loads every shared library in $CUSTOM_DEVICE_ROOT and calls its InitPlugin(), which
// fills a table of C functions (paddle/phi/backends/device_ext.h). This one registers the
// device type "fakedev" (places fakedev:0, fakedev:1, ...):
//
//  * device memory is host memory (aligned_alloc). Paddle's own allocator sits on top of it, so
//    paddle.device.memory_allocated("fakedev:N") and friends are Paddle's exact statistics. Each
//    device has a capacity (FAKEDEV_MEMORY_MB, per process and device): an allocation beyond it
//    fails the way a full GPU does, so Paddle raises its out-of-memory error.
//  * streams and events exist but every operation is synchronous: a copy or a collective has
//    finished when the call returns, so every event is always complete.
//  * the collectives (XCCL) really move bytes between the rank processes, through one
//    shared-memory segment per communicator (/dev/shm/fakedev.<pid>.<random>).
//
// Environment: FAKEDEV_COUNT (devices, default 8), FAKEDEV_VISIBLE_DEVICES (a comma list: the
// device count becomes its length), FAKEDEV_MEMORY_MB (capacity of each device, default 16384),
// FAKEDEV_COMM_TIMEOUT_S (how long a rank waits for its peers before failing, default 600),
// FAKEDEV_COMM_BUFFER_KB (bytes each rank stages per step of a collective, default 4096; small
// values exercise the chunking), FAKEDEV_DEBUG=1 (a line on stderr per communicator event).
//
// The why of the design is in README.md next to this file.

#include "paddle/phi/backends/device_ext.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <complex>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

// The runtime's opaque handles: Paddle only stores and passes back the pointers.
struct C_Stream_st {
  int device;
};
struct C_Event_st {
  int device;
};

namespace {

// ------------------------------------------------------------------------------------------
// Configuration (read once, from the environment of the process)
// ------------------------------------------------------------------------------------------

long env_long(const char* name, long fallback, long lo, long hi) {
  const char* s = getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  char* end = nullptr;
  long v = strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) {
    fprintf(stderr, "fakedev: ignoring %s=%s (want an integer in [%ld, %ld]); using %ld\n",
            name, s, lo, hi, fallback);
    return fallback;
  }
  return v;
}

struct Config {
  size_t device_count;
  size_t memory_bytes;      // capacity of each device
  double timeout_s;         // how long a collective waits for its peers
  size_t buffer_bytes;      // per-rank staging bytes of one collective step
  bool debug;
};

const Config& config() {
  static const Config cfg = [] {
    Config c;
    c.device_count = static_cast<size_t>(env_long("FAKEDEV_COUNT", 8, 1, 1024));
    const char* visible = getenv("FAKEDEV_VISIBLE_DEVICES");
    if (visible != nullptr && *visible != '\0' && strcmp(visible, "all") != 0) {
      // like CUDA_VISIBLE_DEVICES: the process sees as many devices as are listed
      c.device_count = 1 + static_cast<size_t>(std::count(visible, visible + strlen(visible), ','));
    }
    c.memory_bytes = static_cast<size_t>(env_long("FAKEDEV_MEMORY_MB", 16384, 1, 1L << 24)) << 20;
    c.timeout_s = static_cast<double>(env_long("FAKEDEV_COMM_TIMEOUT_S", 600, 1, 1L << 30));
    c.buffer_bytes = static_cast<size_t>(env_long("FAKEDEV_COMM_BUFFER_KB", 4096, 1, 1L << 20)) << 10;
    const char* dbg = getenv("FAKEDEV_DEBUG");
    c.debug = dbg != nullptr && *dbg != '\0' && strcmp(dbg, "0") != 0;
    return c;
  }();
  return cfg;
}

// The timeout may be changed at run time (fakedev_set_comm_timeout, for tests of the timeout).
std::atomic<double> g_timeout_s{-1.0};

double timeout_s() {
  const double t = g_timeout_s.load();
  return t > 0 ? t : config().timeout_s;
}

void debug(const char* fmt, ...) {
  if (!config().debug) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "fakedev[%d]: ", static_cast<int>(getpid()));
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

// Errors are printed here because Paddle only reports "CustomDevice error, the error code is: N".
void error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "fakedev[%d] ERROR: ", static_cast<int>(getpid()));
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  fflush(stderr);
  va_end(ap);
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void sleep_us(long us) {
  timespec ts{us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, nullptr);
}

// ------------------------------------------------------------------------------------------
// Devices and memory
// ------------------------------------------------------------------------------------------

// Paddle's auto-growth allocator places blocks at chunk offsets that are multiples of this
// (device_min_chunk_size); 256 bytes is what CUDA guarantees, so sizes round the same way.
constexpr size_t kAlignment = 256;
constexpr size_t kMaxDevices = 1024;

std::atomic<size_t> g_used[kMaxDevices];  // bytes handed out per device, in this process
thread_local int t_current_device = 0;

bool valid_device(const C_Device d) {
  return d != nullptr && d->id >= 0 && static_cast<size_t>(d->id) < config().device_count;
}

C_Status init_device(const C_Device d) { return valid_device(d) ? C_SUCCESS : C_ERROR; }

C_Status set_device(const C_Device d) {
  if (!valid_device(d)) return C_ERROR;
  t_current_device = d->id;
  return C_SUCCESS;
}

C_Status get_device(const C_Device d) {
  d->id = t_current_device;
  return C_SUCCESS;
}

C_Status deinit_device(const C_Device) { return C_SUCCESS; }

C_Status get_device_count(size_t* count) {
  *count = config().device_count;
  return C_SUCCESS;
}

C_Status get_device_list(size_t* devices) {
  for (size_t i = 0; i < config().device_count; ++i) devices[i] = i;
  return C_SUCCESS;
}

// Over capacity the plugin returns success with a null pointer: Paddle's CustomAllocator then
// throws its BadAlloc ("Out of memory error on fakedev:N"), the auto-growth allocator frees its
// cached idle chunks and retries once, as on a GPU. A non-success status would instead become a
// generic "CustomDevice error" that no allocator retries.
C_Status device_memory_allocate(const C_Device d, void** ptr, size_t size) {
  *ptr = nullptr;
  if (!valid_device(d)) return C_ERROR;
  const size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
  std::atomic<size_t>& used = g_used[d->id];
  size_t before = used.load();
  do {
    if (rounded > config().memory_bytes || before > config().memory_bytes - rounded) {
      debug("allocation of %zu bytes on fakedev:%d refused (%zu of %zu in use)", size, d->id,
            before, config().memory_bytes);
      return C_SUCCESS;
    }
  } while (!used.compare_exchange_weak(before, before + rounded));
  void* p = aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (p == nullptr) {
    used.fetch_sub(rounded);
    return C_SUCCESS;
  }
  *ptr = p;
  return C_SUCCESS;
}

C_Status device_memory_deallocate(const C_Device d, void* ptr, size_t size) {
  if (!valid_device(d)) return C_ERROR;
  if (ptr == nullptr) return C_SUCCESS;
  free(ptr);
  g_used[d->id].fetch_sub((size + kAlignment - 1) / kAlignment * kAlignment);
  return C_SUCCESS;
}

C_Status device_memory_set(const C_Device, void* ptr, unsigned char value, size_t size) {
  memset(ptr, value, size);
  return C_SUCCESS;
}

// "Pinned" host memory and unified memory are plain host memory, not counted as device memory.
C_Status host_memory_allocate(const C_Device, void** ptr, size_t size) {
  *ptr = aligned_alloc(kAlignment, std::max(kAlignment, (size + kAlignment - 1) / kAlignment * kAlignment));
  return *ptr != nullptr ? C_SUCCESS : C_FAILED;
}

C_Status host_memory_deallocate(const C_Device, void* ptr, size_t) {
  free(ptr);
  return C_SUCCESS;
}

C_Status device_memory_stats(const C_Device d, size_t* total, size_t* free_bytes) {
  if (!valid_device(d)) return C_ERROR;
  const size_t used = g_used[d->id].load();
  *total = config().memory_bytes;
  *free_bytes = used >= *total ? 0 : *total - used;
  return C_SUCCESS;
}

C_Status device_min_chunk_size(const C_Device, size_t* size) {
  *size = kAlignment;
  return C_SUCCESS;
}

// memmove: Paddle may copy a tensor onto itself (in-place ops, D2D of a view).
C_Status copy(const C_Device, void* dst, const void* src, size_t size) {
  if (size != 0 && dst != src) memmove(dst, src, size);
  return C_SUCCESS;
}

C_Status copy_async(const C_Device d, C_Stream, void* dst, const void* src, size_t size) {
  return copy(d, dst, src, size);
}

C_Status copy_p2p(const C_Device, const C_Device, void* dst, const void* src, size_t size) {
  if (size != 0 && dst != src) memmove(dst, src, size);
  return C_SUCCESS;
}

C_Status copy_p2p_async(const C_Device a, const C_Device b, C_Stream, void* dst, const void* src,
                        size_t size) {
  return copy_p2p(a, b, dst, src, size);
}

// ------------------------------------------------------------------------------------------
// Streams and events: everything already happened when the call returned.
// ------------------------------------------------------------------------------------------

C_Status create_stream(const C_Device d, C_Stream* stream) {
  *stream = new C_Stream_st{d != nullptr ? d->id : 0};
  return C_SUCCESS;
}

C_Status destroy_stream(const C_Device, C_Stream stream) {
  delete stream;
  return C_SUCCESS;
}

C_Status stream_ok(const C_Device, C_Stream) { return C_SUCCESS; }

// The stream is always drained, so a callback may run at once, on the caller's thread.
C_Status stream_add_callback(const C_Device d, C_Stream s, C_Callback cb, void* user_data) {
  C_Status status = C_SUCCESS;
  cb(d, s, user_data, &status);
  return C_SUCCESS;
}

C_Status create_event(const C_Device d, C_Event* event) {
  *event = new C_Event_st{d != nullptr ? d->id : 0};
  return C_SUCCESS;
}

C_Status destroy_event(const C_Device, C_Event event) {
  delete event;
  return C_SUCCESS;
}

C_Status record_event(const C_Device, C_Stream, C_Event) { return C_SUCCESS; }
C_Status event_ok(const C_Device, C_Event) { return C_SUCCESS; }
C_Status stream_wait_event(const C_Device, C_Stream, C_Event) { return C_SUCCESS; }
C_Status synchronize_device(const C_Device) { return C_SUCCESS; }

C_Status flag_true(const C_Device, bool* supported) {
  *supported = true;
  return C_SUCCESS;
}

C_Status flag_false(const C_Device, bool* supported) {
  *supported = false;
  return C_SUCCESS;
}

// ------------------------------------------------------------------------------------------
// Shared-memory communicators
// ------------------------------------------------------------------------------------------
//
// One segment per communicator, created by its rank 0 under a name made of rank 0's pid and 128
// random bits (the unique id Paddle passes to every rank through its TCP store), so two jobs on
// one machine never meet. Every rank maps it and counts itself in; the last one to arrive
// unlinks the name, so nothing stays in /dev/shm while the job runs and the memory goes when the
// last rank unmaps it (at destroy or at exit, also when killed). A segment whose ranks never all
// arrived (a job killed during the creation of a communicator) keeps its name: any later rank 0
// on the machine removes names whose creator pid no longer exists.
//
// Layout: Header | slots (one per rank, buffer_bytes each) | channels (one per ordered pair of
// ranks, for send/recv) | channel buffers (channel_bytes each).
//
// Collectives proceed in steps: each rank copies up to buffer_bytes of its input into its own
// slot, all ranks meet at a barrier, each reads what it needs from the slots (all ranks reduce in
// rank order, so every rank computes bit-identical results), and all meet again before the slots
// are reused. Send/recv use a one-chunk mailbox per ordered pair of ranks (see "Point to point").

constexpr char kIdMagic[8] = {'F', 'A', 'K', 'E', 'D', 'E', 'V', '1'};
constexpr uint64_t kSegmentMagic = 0x46414b4544455631ULL;  // "FAKEDEV1"
constexpr size_t kMaxRanks = 4096;
constexpr size_t kCacheLine = 64;

struct UniqueId {
  char magic[8];
  uint32_t creator_pid;
  uint32_t buffer_kb;
  uint8_t random[16];
};

struct alignas(kCacheLine) Header {
  uint64_t magic;
  uint64_t nranks;
  uint64_t buffer_bytes;
  uint64_t channel_bytes;
  uint64_t total_bytes;
  alignas(kCacheLine) std::atomic<uint32_t> ready;     // rank 0 finished initialising
  alignas(kCacheLine) std::atomic<uint32_t> attached;  // ranks that mapped the segment
  alignas(kCacheLine) std::atomic<uint32_t> aborted;   // a rank gave up: the others fail fast
  alignas(kCacheLine) std::atomic<uint32_t> arrived;   // barrier: ranks in the current round
  alignas(kCacheLine) std::atomic<uint32_t> round;     // barrier: completed rounds (futex word)
  alignas(kCacheLine) std::atomic<int32_t> pids[kMaxRanks];
};

// A one-chunk mailbox from one rank to another: the sender writes when posted == taken.
struct alignas(kCacheLine) Channel {
  std::atomic<uint32_t> posted;  // chunks written by the sender (futex word)
  uint32_t pad0;
  uint64_t bytes;                // size of the chunk in the buffer
  alignas(kCacheLine) std::atomic<uint32_t> taken;  // chunks consumed by the receiver (futex word)
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain 32-bit");

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // FUTEX_WAIT/WAKE without _PRIVATE: the word lives in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void wake_all(std::atomic<uint32_t>* word) { futex(word, FUTEX_WAKE, INT32_MAX, nullptr); }

std::string hex(const uint8_t* p, size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

bool pid_alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }

// Removes /dev/shm/fakedev.<pid>.* whose creator is gone (a job killed while a communicator was
// being created). Returns how many it removed. Also exported for the tests (fakedev_cleanup).
int cleanup_stale_segments() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (dirent* e = readdir(dir)) {
    int pid = 0;
    char rest[64];
    if (sscanf(e->d_name, "fakedev.%d.%63s", &pid, rest) != 2 || pid_alive(pid)) continue;
    std::string name = std::string("/") + e->d_name;
    if (shm_unlink(name.c_str()) == 0) {
      ++removed;
      debug("removed stale segment %s (creator pid %d is gone)", name.c_str(), pid);
    }
  }
  closedir(dir);
  return removed;
}

}  // namespace

struct C_CCLComm_st {
  std::string name;  // shm name, also the communicator's name for Paddle
  size_t rank = 0;
  size_t nranks = 0;
  size_t buffer_bytes = 0;
  size_t channel_bytes = 0;
  size_t map_bytes = 0;
  uint8_t* base = nullptr;
  Header* hdr = nullptr;
  double next_peer_check = 0;

  uint8_t* slot(size_t r) const { return base + sizeof(Header) + r * buffer_bytes; }
  Channel* channel(size_t src, size_t dst) const {
    auto* first = reinterpret_cast<Channel*>(base + sizeof(Header) + nranks * buffer_bytes);
    return first + src * nranks + dst;
  }
  uint8_t* channel_buffer(size_t src, size_t dst) const {
    return base + sizeof(Header) + nranks * buffer_bytes + nranks * nranks * sizeof(Channel) +
           (src * nranks + dst) * channel_bytes;
  }
};

namespace {

size_t segment_bytes(size_t nranks, size_t buffer_bytes, size_t channel_bytes) {
  return sizeof(Header) + nranks * buffer_bytes + nranks * nranks * (sizeof(Channel) + channel_bytes);
}

// Why a wait ended without the condition: the caller reports and fails.
C_Status give_up(C_CCLComm c, const char* what, const char* why) {
  error("rank %zu of %zu (communicator %s) gave up in %s: %s", c->rank, c->nranks, c->name.c_str(),
        what, why);
  if (c->hdr != nullptr) c->hdr->aborted.store(1);
  return C_ERROR;
}

// What ends a wait early: a peer gave up, a peer process is gone (checked once a second), the
// deadline passed. Empty if none.
std::string wait_problem(C_CCLComm c, double deadline, double* next_peer_check) {
  if (c->hdr->aborted.load() != 0) return "another rank of this communicator failed first";
  const double t = now_s();
  if (t >= *next_peer_check) {
    *next_peer_check = t + 1.0;
    for (size_t r = 0; r < c->nranks; ++r) {
      const int pid = c->hdr->pids[r].load();
      if (pid != 0 && !pid_alive(pid)) {
        return "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") exited";
      }
    }
  }
  if (t >= deadline) {
    char why[160];
    snprintf(why, sizeof(why), "its peers did not arrive within %.0f s (FAKEDEV_COMM_TIMEOUT_S)",
             timeout_s());
    return why;
  }
  return "";
}

C_Status check_waiting(C_CCLComm c, double deadline, const char* what) {
  const std::string why = wait_problem(c, deadline, &c->next_peer_check);
  return why.empty() ? C_SUCCESS : give_up(c, what, why.c_str());
}

// Blocks while *word == value: a short spin (peers usually arrive within microseconds), then
// futex waits of at most 50 ms, so a waiting rank costs no CPU and still notices a deadline,
// an aborted communicator or a dead peer.
C_Status wait_while(C_CCLComm c, std::atomic<uint32_t>* word, uint32_t value, const char* what) {
  for (int i = 0; i < 64; ++i) {
    if (word->load(std::memory_order_acquire) != value) return C_SUCCESS;
    if (i >= 16) sched_yield();
  }
  const double deadline = now_s() + timeout_s();
  const timespec slice{0, 50 * 1000 * 1000};
  while (word->load(std::memory_order_acquire) == value) {
    futex(word, FUTEX_WAIT, value, &slice);
    if (word->load(std::memory_order_acquire) != value) break;
    if (check_waiting(c, deadline, what) != C_SUCCESS) return C_ERROR;
  }
  return C_SUCCESS;
}

// All ranks of the communicator meet. The round counter is read before arriving, so a rank
// cannot miss the round it is part of; the last to arrive resets the count, then opens the round.
C_Status barrier(C_CCLComm c, const char* what) {
  Header* h = c->hdr;
  const uint32_t round = h->round.load(std::memory_order_acquire);
  if (h->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == c->nranks) {
    h->arrived.store(0, std::memory_order_relaxed);
    h->round.store(round + 1, std::memory_order_release);
    wake_all(&h->round);
    return C_SUCCESS;
  }
  return wait_while(c, &h->round, round, what);
}

// ------------------------------------------------------------------------------------------
// Element types and reductions
// ------------------------------------------------------------------------------------------

size_t dtype_size(C_DataType t) {
  switch (t) {
    case BOOL: case UINT8: case INT8: return 1;
    case UINT16: case INT16: case FLOAT16: case BFLOAT16: return 2;
    case UINT32: case INT32: case FLOAT32: return 4;
    case UINT64: case INT64: case FLOAT64: case COMPLEX64: return 8;
    case COMPLEX128: return 16;
    default: return 0;
  }
}

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float f;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  uint32_t u = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                         : (sign | ((exp + 112u) << 23) | (mant << 13));
  memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;        // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;       // >= 65520 rounds to infinity
  if (a < 0x38800000u) {                             // below 2^-14: subnormal (or zero)
    float m;
    memcpy(&m, &a, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(m * 16777216.0f));  // * 2^24
  }
  uint32_t h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3ffu);
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: right
  return sign | static_cast<uint16_t>(h);
}

// dst[i] = reduce over ranks r (in rank order) of src[r][i]. Floating point sums are accumulated
// in the widest type at hand (half and bfloat16 in float), then rounded once: every rank gets the
// same bits, which is what matters here; NCCL's rounding order differs in the last bit.
template <typename T, typename Acc, typename Load, typename Store>
bool reduce_typed(void* dst, const std::vector<const uint8_t*>& src, size_t n, C_CCLReduceOp op,
                  Load load, Store store) {
  T* out = static_cast<T*>(dst);
  const size_t k = src.size();
  for (size_t i = 0; i < n; ++i) {
    Acc acc = load(reinterpret_cast<const T*>(src[0])[i]);
    for (size_t r = 1; r < k; ++r) {
      const Acc v = load(reinterpret_cast<const T*>(src[r])[i]);
      switch (op) {
        case SUM: case AVG: acc = acc + v; break;
        case PRODUCT: acc = acc * v; break;
        case MAX:
        case MIN:
          if constexpr (std::is_arithmetic_v<Acc>) {
            // a NaN on any rank propagates, whatever the rank order
            acc = (op == MAX) ? (v > acc || v != v ? v : acc) : (v < acc || v != v ? v : acc);
            break;
          } else {
            return false;
          }
        default: return false;
      }
    }
    if (op == AVG) acc = acc / static_cast<Acc>(k);
    out[i] = store(acc);
  }
  return true;
}

// Integers wrap on overflow like NCCL's, without signed-overflow undefined behaviour.
template <typename T>
bool reduce_int(void* dst, const std::vector<const uint8_t*>& src, size_t n, C_CCLReduceOp op) {
  using U = std::make_unsigned_t<T>;
  T* out = static_cast<T*>(dst);
  const size_t k = src.size();
  for (size_t i = 0; i < n; ++i) {
    T acc = reinterpret_cast<const T*>(src[0])[i];
    for (size_t r = 1; r < k; ++r) {
      const T v = reinterpret_cast<const T*>(src[r])[i];
      switch (op) {
        case SUM: case AVG: acc = static_cast<T>(static_cast<U>(acc) + static_cast<U>(v)); break;
        case PRODUCT: acc = static_cast<T>(static_cast<U>(acc) * static_cast<U>(v)); break;
        case MAX: acc = std::max(acc, v); break;
        case MIN: acc = std::min(acc, v); break;
        default: return false;
      }
    }
    if (op == AVG) acc = static_cast<T>(acc / static_cast<T>(k));
    out[i] = acc;
  }
  return true;
}

template <typename C>
bool reduce_complex(void* dst, const std::vector<const uint8_t*>& src, size_t n, C_CCLReduceOp op) {
  if (op == MAX || op == MIN) return false;
  auto id = [](C v) { return v; };
  return reduce_typed<C, C>(dst, src, n, op, id, id);
}

bool reduce(void* dst, const std::vector<const uint8_t*>& src, size_t n, C_DataType t,
            C_CCLReduceOp op) {
  auto id_f = [](float v) { return v; };
  auto id_d = [](double v) { return v; };
  switch (t) {
    case FLOAT32: return reduce_typed<float, float>(dst, src, n, op, id_f, id_f);
    case FLOAT64: return reduce_typed<double, double>(dst, src, n, op, id_d, id_d);
    case FLOAT16: return reduce_typed<uint16_t, float>(dst, src, n, op, half_to_float, float_to_half);
    case BFLOAT16: return reduce_typed<uint16_t, float>(dst, src, n, op, bf16_to_float, float_to_bf16);
    case INT8: return reduce_int<int8_t>(dst, src, n, op);
    case UINT8: return reduce_int<uint8_t>(dst, src, n, op);
    case INT16: return reduce_int<int16_t>(dst, src, n, op);
    case UINT16: return reduce_int<uint16_t>(dst, src, n, op);
    case INT32: return reduce_int<int32_t>(dst, src, n, op);
    case UINT32: return reduce_int<uint32_t>(dst, src, n, op);
    case INT64: return reduce_int<int64_t>(dst, src, n, op);
    case UINT64: return reduce_int<uint64_t>(dst, src, n, op);
    case BOOL: {  // sum/max: any; product/min: all
      auto* out = static_cast<uint8_t*>(dst);
      for (size_t i = 0; i < n; ++i) {
        bool any = false, all = true;
        for (const uint8_t* s : src) {
          any = any || s[i] != 0;
          all = all && s[i] != 0;
        }
        out[i] = (op == PRODUCT || op == MIN) ? all : any;
      }
      return true;
    }
    case COMPLEX64: return reduce_complex<std::complex<float>>(dst, src, n, op);
    case COMPLEX128: return reduce_complex<std::complex<double>>(dst, src, n, op);
    default: return false;
  }
}

const char* op_name(C_CCLReduceOp op) {
  switch (op) {
    case SUM: return "sum";
    case AVG: return "avg";
    case MAX: return "max";
    case MIN: return "min";
    case PRODUCT: return "prod";
    default: return "?";
  }
}

// ------------------------------------------------------------------------------------------
// Communicator creation
// ------------------------------------------------------------------------------------------

C_Status get_unique_id_size(size_t* size) {
  *size = sizeof(UniqueId);
  return C_SUCCESS;
}

C_Status get_unique_id(C_CCLRootId* root) {
  if (root == nullptr || root->data == nullptr || root->sz < sizeof(UniqueId)) return C_ERROR;
  UniqueId id;
  memcpy(id.magic, kIdMagic, sizeof(kIdMagic));
  id.creator_pid = static_cast<uint32_t>(getpid());
  id.buffer_kb = static_cast<uint32_t>(config().buffer_bytes >> 10);
  size_t got = 0;
  while (got < sizeof(id.random)) {
    ssize_t n = getrandom(id.random + got, sizeof(id.random) - got, 0);
    if (n < 0 && errno != EINTR) {
      error("getrandom failed: %s", strerror(errno));
      return C_INTERNAL_ERROR;
    }
    if (n > 0) got += static_cast<size_t>(n);
  }
  memset(root->data, 0, root->sz);
  memcpy(root->data, &id, sizeof(id));
  return C_SUCCESS;
}

void drain_sends(C_CCLComm c);

C_Status destroy_comm(C_CCLComm c) {
  if (c == nullptr) return C_SUCCESS;
  debug("destroy %s (rank %zu)", c->name.c_str(), c->rank);
  drain_sends(c);
  if (c->base != nullptr) munmap(c->base, c->map_bytes);
  delete c;
  return C_SUCCESS;
}

C_Status comm_init_rank(size_t nranks, C_CCLRootId* root, size_t rank, C_CCLComm* out) {
  *out = nullptr;
  UniqueId id;
  if (root == nullptr || root->sz < sizeof(UniqueId) || nranks == 0 || nranks > kMaxRanks ||
      rank >= nranks) {
    error("comm_init_rank: bad arguments (nranks %zu, rank %zu)", nranks, rank);
    return C_ERROR;
  }
  memcpy(&id, root->data, sizeof(id));
  if (memcmp(id.magic, kIdMagic, sizeof(kIdMagic)) != 0) {
    error("comm_init_rank: the unique id was not made by fakedev");
    return C_ERROR;
  }
  auto c = std::make_unique<C_CCLComm_st>();
  c->name = "/fakedev." + std::to_string(id.creator_pid) + "." + hex(id.random, sizeof(id.random));
  c->rank = rank;
  c->nranks = nranks;
  c->buffer_bytes = static_cast<size_t>(id.buffer_kb) << 10;  // rank 0's choice, for every rank
  c->channel_bytes = std::max<size_t>(c->buffer_bytes / 4, 1024);
  c->map_bytes = segment_bytes(nranks, c->buffer_bytes, c->channel_bytes);
  const double deadline = now_s() + timeout_s();
  const char* what = "communicator creation";

  int fd = -1;
  if (rank == 0) {
    cleanup_stale_segments();
    fd = shm_open(c->name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(c->map_bytes)) != 0) {
      error("cannot create /dev/shm%s (%zu bytes): %s", c->name.c_str(), c->map_bytes, strerror(errno));
      if (fd >= 0) {
        close(fd);
        shm_unlink(c->name.c_str());
      }
      return C_ERROR;
    }
  } else {
    // rank 0 may not have created it yet: wait with backoff (no CPU burnt)
    long pause = 100;
    for (;;) {
      fd = shm_open(c->name.c_str(), O_RDWR, 0600);
      if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == c->map_bytes) break;
        close(fd);  // created but not sized yet
        fd = -1;
      } else if (errno != ENOENT) {
        error("cannot open /dev/shm%s: %s", c->name.c_str(), strerror(errno));
        return C_ERROR;
      }
      if (now_s() >= deadline) {
        error("rank %zu of %zu gave up in %s: rank 0 did not create /dev/shm%s within %.0f s "
              "(FAKEDEV_COMM_TIMEOUT_S)", rank, nranks, what, c->name.c_str(), timeout_s());
        return C_ERROR;
      }
      sleep_us(pause);
      pause = std::min(pause * 2, 20000L);
    }
  }
  void* p = mmap(nullptr, c->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    error("cannot map /dev/shm%s: %s", c->name.c_str(), strerror(errno));
    if (rank == 0) shm_unlink(c->name.c_str());
    return C_ERROR;
  }
  c->base = static_cast<uint8_t*>(p);
  c->hdr = reinterpret_cast<Header*>(p);
  Header* h = c->hdr;
  if (rank == 0) {
    // the file is zero-filled: every counter starts at 0
    h->magic = kSegmentMagic;
    h->nranks = nranks;
    h->buffer_bytes = c->buffer_bytes;
    h->channel_bytes = c->channel_bytes;
    h->total_bytes = c->map_bytes;
    h->ready.store(1, std::memory_order_release);
    wake_all(&h->ready);
  } else if (wait_while(c.get(), &h->ready, 0, what) != C_SUCCESS) {
    return C_ERROR;
  }
  if (h->magic != kSegmentMagic || h->nranks != nranks || h->total_bytes != c->map_bytes) {
    error("rank %zu: /dev/shm%s was made for %llu ranks, this rank was told %zu", rank,
          c->name.c_str(), static_cast<unsigned long long>(h->nranks), nranks);
    return C_ERROR;
  }
  h->pids[rank].store(static_cast<int32_t>(getpid()));
  const uint32_t now_attached = h->attached.fetch_add(1) + 1;
  if (now_attached == nranks) {
    shm_unlink(c->name.c_str());  // everybody has it mapped: the name is no longer needed
    debug("%s: all %zu ranks attached, name unlinked", c->name.c_str(), nranks);
  }
  wake_all(&h->attached);
  for (uint32_t seen = h->attached.load(); seen < nranks; seen = h->attached.load()) {
    if (wait_while(c.get(), &h->attached, seen, what) != C_SUCCESS) {
      if (rank == 0) shm_unlink(c->name.c_str());
      return C_ERROR;
    }
  }
  debug("init %s rank %zu of %zu (buffer %zu bytes)", c->name.c_str(), rank, nranks, c->buffer_bytes);
  *out = c.release();
  return C_SUCCESS;
}

C_Status get_comm_name(C_CCLComm c, char* name) {
  // Paddle's buffer is 128 bytes; the name is about 50
  snprintf(name, 128, "%s", c->name.c_str() + 1);
  return C_SUCCESS;
}

// ------------------------------------------------------------------------------------------
// Collectives
// ------------------------------------------------------------------------------------------

C_Status bad_type(C_CCLComm c, const char* what, C_DataType t) {
  return give_up(c, what, ("unsupported data type " + std::to_string(static_cast<int>(t))).c_str());
}

C_Status all_reduce(void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op,
                    C_CCLComm c, C_Stream) {
  const size_t es = dtype_size(t);
  if (es == 0) return bad_type(c, "all_reduce", t);
  debug("all_reduce %s %zu x %zu bytes", op_name(op), count, es);
  const size_t step = c->buffer_bytes / es;
  std::vector<const uint8_t*> src(c->nranks);
  for (size_t off = 0; off < count; off += step) {
    const size_t n = std::min(step, count - off);
    memcpy(c->slot(c->rank), static_cast<const uint8_t*>(send) + off * es, n * es);
    if (barrier(c, "all_reduce") != C_SUCCESS) return C_ERROR;
    for (size_t r = 0; r < c->nranks; ++r) src[r] = c->slot(r);
    if (!reduce(static_cast<uint8_t*>(recv) + off * es, src, n, t, op)) {
      return give_up(c, "all_reduce", "unsupported reduction for this data type");
    }
    if (barrier(c, "all_reduce") != C_SUCCESS) return C_ERROR;
  }
  return C_SUCCESS;
}

C_Status reduce_to_root(void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op,
                        size_t root, C_CCLComm c, C_Stream) {
  const size_t es = dtype_size(t);
  if (es == 0) return bad_type(c, "reduce", t);
  if (root >= c->nranks) return give_up(c, "reduce", "root out of range");
  debug("reduce %s %zu x %zu bytes to %zu", op_name(op), count, es, root);
  const size_t step = c->buffer_bytes / es;
  std::vector<const uint8_t*> src(c->nranks);
  for (size_t off = 0; off < count; off += step) {
    const size_t n = std::min(step, count - off);
    memcpy(c->slot(c->rank), static_cast<const uint8_t*>(send) + off * es, n * es);
    if (barrier(c, "reduce") != C_SUCCESS) return C_ERROR;
    if (c->rank == root) {
      for (size_t r = 0; r < c->nranks; ++r) src[r] = c->slot(r);
      if (!reduce(static_cast<uint8_t*>(recv) + off * es, src, n, t, op)) {
        return give_up(c, "reduce", "unsupported reduction for this data type");
      }
    }
    if (barrier(c, "reduce") != C_SUCCESS) return C_ERROR;
  }
  return C_SUCCESS;
}

C_Status broadcast(void* buf, size_t count, C_DataType t, size_t root, C_CCLComm c, C_Stream) {
  const size_t es = dtype_size(t);
  if (es == 0) return bad_type(c, "broadcast", t);
  if (root >= c->nranks) return give_up(c, "broadcast", "root out of range");
  debug("broadcast %zu x %zu bytes from %zu", count, es, root);
  const size_t step = c->buffer_bytes / es;
  for (size_t off = 0; off < count; off += step) {
    const size_t n = std::min(step, count - off);
    uint8_t* mine = static_cast<uint8_t*>(buf) + off * es;
    if (c->rank == root) memcpy(c->slot(root), mine, n * es);
    if (barrier(c, "broadcast") != C_SUCCESS) return C_ERROR;
    if (c->rank != root) memcpy(mine, c->slot(root), n * es);
    if (barrier(c, "broadcast") != C_SUCCESS) return C_ERROR;
  }
  return C_SUCCESS;
}

// recv holds nranks blocks of count elements, block r from rank r. In place works when send is
// this rank's own block of recv (as with NCCL).
C_Status all_gather(void* send, void* recv, size_t count, C_DataType t, C_CCLComm c, C_Stream) {
  const size_t es = dtype_size(t);
  if (es == 0) return bad_type(c, "all_gather", t);
  debug("all_gather %zu x %zu bytes", count, es);
  const size_t step = c->buffer_bytes / es;
  for (size_t off = 0; off < count; off += step) {
    const size_t n = std::min(step, count - off);
    memcpy(c->slot(c->rank), static_cast<const uint8_t*>(send) + off * es, n * es);
    if (barrier(c, "all_gather") != C_SUCCESS) return C_ERROR;
    for (size_t r = 0; r < c->nranks; ++r) {
      memcpy(static_cast<uint8_t*>(recv) + (r * count + off) * es, c->slot(r), n * es);
    }
    if (barrier(c, "all_gather") != C_SUCCESS) return C_ERROR;
  }
  return C_SUCCESS;
}

// send holds nranks blocks of count elements; rank r receives the reduction of every rank's
// block r.
C_Status reduce_scatter(void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op,
                        C_CCLComm c, C_Stream) {
  const size_t es = dtype_size(t);
  if (es == 0) return bad_type(c, "reduce_scatter", t);
  debug("reduce_scatter %s %zu x %zu bytes", op_name(op), count, es);
  const size_t step = std::max<size_t>(1, c->buffer_bytes / (es * c->nranks));
  if (step * es * c->nranks > c->buffer_bytes) {
    return give_up(c, "reduce_scatter", "FAKEDEV_COMM_BUFFER_KB too small for this many ranks");
  }
  std::vector<const uint8_t*> src(c->nranks);
  for (size_t off = 0; off < count; off += step) {
    const size_t n = std::min(step, count - off);
    for (size_t b = 0; b < c->nranks; ++b) {  // block b of my input, this step's part
      memcpy(c->slot(c->rank) + b * n * es, static_cast<const uint8_t*>(send) + (b * count + off) * es,
             n * es);
    }
    if (barrier(c, "reduce_scatter") != C_SUCCESS) return C_ERROR;
    for (size_t r = 0; r < c->nranks; ++r) src[r] = c->slot(r) + c->rank * n * es;
    if (!reduce(static_cast<uint8_t*>(recv) + off * es, src, n, t, op)) {
      return give_up(c, "reduce_scatter", "unsupported reduction for this data type");
    }
    if (barrier(c, "reduce_scatter") != C_SUCCESS) return C_ERROR;
  }
  return C_SUCCESS;
}

// ------------------------------------------------------------------------------------------
// Point to point
// ------------------------------------------------------------------------------------------

// A send never waits for its receiver (as with NCCL, whose sends are queued on a stream): what
// the mailbox does not take at once is copied and handed to one background thread per process,
// which pushes it chunk by chunk, in order per (communicator, destination). A receive blocks
// until its bytes arrived (Paddle reads the buffer as soon as the call returns: every event of
// this device is complete). So sends before receives in any order complete, batch_isend_irecv
// rings included (Paddle 3.3.1 issues those one by one, without group calls, on this device).

// Progress of one message through the mailbox of one ordered pair of ranks.
struct Transfer {
  C_CCLComm comm;
  size_t peer;
  bool is_send;
  uint8_t* buf;
  size_t bytes;
  size_t done = 0;
  bool started = false;  // a zero-byte message still moves one (empty) chunk
  bool finished() const { return started && done >= bytes; }

  Channel* channel() const { return is_send ? comm->channel(comm->rank, peer) : comm->channel(peer, comm->rank); }

  // One chunk, if the mailbox allows it now; returns whether one moved. Sets *status on a
  // size mismatch.
  bool step(C_Status* status) {
    if (finished()) return false;
    C_CCLComm c = comm;
    Channel* ch = channel();
    if (is_send) {
      const uint32_t posted = ch->posted.load(std::memory_order_relaxed);
      if (ch->taken.load(std::memory_order_acquire) != posted) return false;  // still full
      const size_t n = std::min(c->channel_bytes, bytes - done);
      memcpy(c->channel_buffer(c->rank, peer), buf + done, n);
      ch->bytes = n;
      ch->posted.store(posted + 1, std::memory_order_release);
      wake_all(&ch->posted);
      done += n;
    } else {
      const uint32_t taken = ch->taken.load(std::memory_order_relaxed);
      if (ch->posted.load(std::memory_order_acquire) == taken) return false;  // still empty
      const size_t n = ch->bytes;
      if (n > bytes - done) {
        *status = give_up(c, "recv", "the sender sent more bytes than this receive expects");
        return false;
      }
      memcpy(buf + done, c->channel_buffer(peer, c->rank), n);
      ch->taken.store(taken + 1, std::memory_order_release);
      wake_all(&ch->taken);
      done += n;
    }
    started = true;
    return true;
  }

  // The futex word, and its value while this transfer cannot move.
  std::atomic<uint32_t>* blocked_on(uint32_t* value) const {
    Channel* ch = channel();
    if (is_send) {
      *value = ch->posted.load() - 1;  // full while taken == posted - 1
      return &ch->taken;
    }
    *value = ch->taken.load();  // empty while posted == taken
    return &ch->posted;
  }
};

// ---- the sender thread ----

struct PendingSend {
  Transfer t;
  std::unique_ptr<uint8_t[]> copy;  // the bytes not yet pushed (t.buf points into it)
  double deadline;
  double next_peer_check;
};

// Allocated once and never freed: the detached thread may still wait on them while the process
// exits, and destroying a condition variable that has a waiter hangs in glibc.
struct SendQueue {
  std::mutex mu;
  std::condition_variable cv;  // a send was queued, or the queue of a communicator drained
  std::list<PendingSend> pending;  // in submission order
  bool thread_running = false;
};
SendQueue& queue() {
  static SendQueue* q = new SendQueue;
  return *q;
}

bool pending_for(C_CCLComm c, size_t dst) {
  for (const PendingSend& p : queue().pending) {
    if (p.t.comm == c && (dst == SIZE_MAX || p.t.peer == dst)) return true;
  }
  return false;
}

// Pushes the oldest pending message of every (communicator, destination) as far as the mailboxes
// allow. Drops the messages of communicators that failed. Called with queue().mu held.
bool progress_pending() {
  bool moved = false;
  std::vector<std::pair<C_CCLComm, size_t>> heads;
  for (auto it = queue().pending.begin(); it != queue().pending.end();) {
    const auto key = std::make_pair(it->t.comm, it->t.peer);
    if (std::find(heads.begin(), heads.end(), key) != heads.end()) {
      ++it;  // an older message to the same rank goes first
      continue;
    }
    heads.push_back(key);
    C_Status status = C_SUCCESS;
    bool stepped = false;
    while (it->t.step(&status)) stepped = true;
    if (stepped) {
      moved = true;
      it->deadline = now_s() + timeout_s();  // the timeout counts from the last progress
    }
    if (it->t.finished()) {
      it = queue().pending.erase(it);
      queue().cv.notify_all();
      continue;
    }
    const std::string why = wait_problem(it->t.comm, it->deadline, &it->next_peer_check);
    if (!why.empty()) {
      give_up(it->t.comm, "send", why.c_str());
      C_CCLComm failed = it->t.comm;
      queue().pending.remove_if([failed](const PendingSend& p) { return p.t.comm == failed; });
      queue().cv.notify_all();
      return true;  // the list changed: start over
    }
    ++it;
  }
  return moved;
}

void sender_thread() {
  std::unique_lock<std::mutex> lock(queue().mu);
  long pause = 20;
  for (;;) {
    queue().cv.wait(lock, [] { return !queue().pending.empty(); });
    if (progress_pending()) {
      pause = 20;
      continue;
    }
    // blocked: the receivers are not there yet. Sleep a little (50 us doubling to 2 ms).
    lock.unlock();
    sleep_us(pause);
    pause = std::min(pause * 2, 2000L);
    lock.lock();
  }
}

C_Status send_bytes(C_CCLComm c, size_t dst, const void* buf, size_t bytes) {
  if (dst >= c->nranks) return give_up(c, "send", "peer out of range");
  if (c->hdr->aborted.load() != 0) return give_up(c, "send", "another rank of this communicator failed first");
  std::lock_guard<std::mutex> lock(queue().mu);
  Transfer t{c, dst, true, static_cast<uint8_t*>(const_cast<void*>(buf)), bytes};
  C_Status status = C_SUCCESS;
  if (!pending_for(c, dst)) {
    while (t.step(&status)) {
    }
    if (t.finished()) return C_SUCCESS;
  }
  // the rest waits for the receiver: keep a copy, the caller may reuse its buffer
  PendingSend p{t, std::make_unique<uint8_t[]>(std::max<size_t>(bytes - t.done, 1)), 0, 0};
  memcpy(p.copy.get(), static_cast<const uint8_t*>(buf) + t.done, bytes - t.done);
  p.t.buf = p.copy.get();  // what is left, from its first byte
  p.t.bytes = bytes - t.done;
  p.t.done = 0;
  p.deadline = now_s() + timeout_s();
  queue().pending.push_back(std::move(p));
  if (!queue().thread_running) {
    std::thread(sender_thread).detach();
    queue().thread_running = true;
  }
  queue().cv.notify_all();
  return C_SUCCESS;
}

// Waits until this communicator's queued sends are gone (before its memory is unmapped).
void drain_sends(C_CCLComm c) {
  std::unique_lock<std::mutex> lock(queue().mu);
  const double deadline = now_s() + timeout_s();
  while (pending_for(c, SIZE_MAX) && now_s() < deadline) {
    queue().cv.wait_for(lock, std::chrono::milliseconds(100));
  }
  queue().pending.remove_if([c](const PendingSend& p) { return p.t.comm == c; });
}

// ---- receives ----

// Completes the receives together. One blocked receive waits on its futex word; several wait with
// short sleeps (50 us doubling to 5 ms), so nobody spins a core.
C_Status run_recvs(std::vector<Transfer>& recvs) {
  if (recvs.empty()) return C_SUCCESS;
  double deadline = now_s() + timeout_s();
  long pause = 50;
  for (;;) {
    bool moved = false, all_done = true;
    C_Status status = C_SUCCESS;
    Transfer* blocked = nullptr;
    size_t pending = 0;
    for (Transfer& t : recvs) {
      while (t.step(&status)) moved = true;
      if (status != C_SUCCESS) return status;
      if (!t.finished()) {
        all_done = false;
        blocked = &t;
        ++pending;
      }
    }
    if (all_done) return C_SUCCESS;
    if (moved) {
      pause = 50;
      deadline = now_s() + timeout_s();  // the timeout counts from the last progress
      continue;
    }
    if (pending == 1) {
      uint32_t value;
      std::atomic<uint32_t>* word = blocked->blocked_on(&value);
      const timespec slice{0, 50 * 1000 * 1000};
      if (word->load(std::memory_order_acquire) == value) futex(word, FUTEX_WAIT, value, &slice);
    } else {
      sleep_us(pause);
      pause = std::min(pause * 2, 5000L);
    }
    if (check_waiting(blocked->comm, deadline, "recv") != C_SUCCESS) return C_ERROR;
  }
}

// group_start/group_end: receives between them complete together at group_end, so that a group
// whose receives come before its sends (in any order) works; sends go out at once anyway.
// Collectives run at once: every rank issues them in the same order.
thread_local int t_group_depth = 0;
thread_local std::vector<Transfer> t_group_recvs;

C_Status group_start() {
  ++t_group_depth;
  return C_SUCCESS;
}

C_Status group_end() {
  if (t_group_depth == 0) return C_ERROR;
  if (--t_group_depth > 0) return C_SUCCESS;
  std::vector<Transfer> recvs;
  recvs.swap(t_group_recvs);
  return run_recvs(recvs);
}

C_Status recv_bytes(C_CCLComm c, size_t src, void* buf, size_t bytes) {
  if (src >= c->nranks) return give_up(c, "recv", "peer out of range");
  Transfer t{c, src, false, static_cast<uint8_t*>(buf), bytes};
  if (t_group_depth > 0) {
    t_group_recvs.push_back(t);
    return C_SUCCESS;
  }
  std::vector<Transfer> one{t};
  return run_recvs(one);
}

C_Status send(void* buf, size_t count, C_DataType t, size_t dst, C_CCLComm c, C_Stream) {
  if (dtype_size(t) == 0) return bad_type(c, "send", t);
  debug("send %zu x %zu bytes to %zu", count, dtype_size(t), dst);
  return send_bytes(c, dst, buf, count * dtype_size(t));
}

C_Status recv(void* buf, size_t count, C_DataType t, size_t src, C_CCLComm c, C_Stream) {
  if (dtype_size(t) == 0) return bad_type(c, "recv", t);
  debug("recv %zu x %zu bytes from %zu", count, dtype_size(t), src);
  return recv_bytes(c, src, buf, count * dtype_size(t));
}

C_Status all_to_all(const void** send_buf, const size_t* send_count, const C_DataType* send_dtype,
                    void** recv_buf, const size_t* recv_count, const C_DataType* recv_dtype,
                    size_t rank, size_t nranks, C_CCLComm c, C_Stream) {
  if (rank != c->rank || nranks != c->nranks) return give_up(c, "all_to_all", "rank/size mismatch");
  debug("all_to_all over %zu ranks", nranks);
  std::vector<Transfer> recvs;
  for (size_t r = 0; r < nranks; ++r) {
    const size_t sb = send_count[r] * dtype_size(send_dtype[r]);
    const size_t rb = recv_count[r] * dtype_size(recv_dtype[r]);
    if (r == rank) {
      if (sb != rb) return give_up(c, "all_to_all", "own block: send and receive sizes differ");
      if (sb != 0) memmove(recv_buf[r], send_buf[r], sb);
      continue;
    }
    if (send_bytes(c, r, send_buf[r], sb) != C_SUCCESS) return C_ERROR;
    recvs.push_back(Transfer{c, r, false, static_cast<uint8_t*>(recv_buf[r]), rb});
  }
  if (t_group_depth > 0) {
    t_group_recvs.insert(t_group_recvs.end(), recvs.begin(), recvs.end());
    return C_SUCCESS;
  }
  return run_recvs(recvs);
}

}  // namespace

// For the tests (ctypes, in a process that loaded the plugin): remove segments left by killed
// jobs, returning how many; change how long collectives wait for peers from now on.
extern "C" int fakedev_cleanup_stale_segments() { return cleanup_stale_segments(); }
extern "C" void fakedev_set_comm_timeout(double seconds) { g_timeout_s.store(seconds); }

extern "C" void InitPlugin(CustomRuntimeParams* params) {
  PADDLE_CUSTOM_RUNTIME_CHECK_VERSION(params);
  params->device_type = const_cast<char*>("fakedev");
  params->sub_device_type = const_cast<char*>("v1");

  // Paddle zero-fills the table: entries left null are optional (or reported as unimplemented)
  C_DeviceInterface* api = params->interface;
  api->init_device = init_device;
  api->set_device = set_device;
  api->get_device = get_device;
  api->deinit_device = deinit_device;

  api->create_stream = create_stream;
  api->destroy_stream = destroy_stream;
  api->query_stream = stream_ok;
  api->synchronize_stream = stream_ok;
  api->stream_add_callback = stream_add_callback;
  api->create_event = create_event;
  api->destroy_event = destroy_event;
  api->record_event = record_event;
  api->query_event = event_ok;
  api->synchronize_event = event_ok;
  api->stream_wait_event = stream_wait_event;
  api->synchronize_device = synchronize_device;

  api->device_memory_allocate = device_memory_allocate;
  api->device_memory_deallocate = device_memory_deallocate;
  api->device_memory_set = device_memory_set;
  api->host_memory_allocate = host_memory_allocate;
  api->host_memory_deallocate = host_memory_deallocate;
  api->unified_memory_allocate = host_memory_allocate;
  api->unified_memory_deallocate = host_memory_deallocate;
  api->memory_copy_h2d = copy;
  api->memory_copy_d2h = copy;
  api->memory_copy_d2d = copy;
  api->memory_copy_p2p = copy_p2p;
  api->async_memory_copy_h2d = copy_async;
  api->async_memory_copy_d2h = copy_async;
  api->async_memory_copy_d2d = copy_async;
  api->async_memory_copy_p2p = copy_p2p_async;

  api->get_device_count = get_device_count;
  api->get_device_list = get_device_list;
  api->device_memory_stats = device_memory_stats;
  api->device_min_chunk_size = device_min_chunk_size;
  api->is_float16_supported = flag_true;
  api->is_bfloat16_supported = flag_true;
  api->is_dnn_supported = flag_false;

  api->xccl_get_comm_name = get_comm_name;
  api->xccl_get_unique_id_size = get_unique_id_size;
  api->xccl_get_unique_id = get_unique_id;
  api->xccl_comm_init_rank = comm_init_rank;
  api->xccl_destroy_comm = destroy_comm;
  api->xccl_all_reduce = all_reduce;
  api->xccl_broadcast = broadcast;
  api->xccl_reduce = reduce_to_root;
  api->xccl_all_gather = all_gather;
  api->xccl_reduce_scatter = reduce_scatter;
  api->xccl_group_start = group_start;
  api->xccl_group_end = group_end;
  api->xccl_send = send;
  api->xccl_recv = recv;
  api->xccl_all_to_all = all_to_all;
}
