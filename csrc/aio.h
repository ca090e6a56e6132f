// AioHandle: file reads and writes of CPU tensors on a pool of C++ worker threads (pread/pwrite),
// the engine behind deepspeed_z3ext.aio_handle (a stand-in for DeepSpeed's async_io handle).
//
// [Note: aio and the GIL] DeepSpeed's handle deadlocked when a blocking call held the GIL while a
// worker needed it (a tensor whose deleter takes the GIL, finished on a worker). Here:
// - workers run pure C++ (syscalls, no Python) except for dropping the op's tensor reference, whose
//   deleter may take the GIL itself;
// - every call that can block (submit: open/statx; wait; close/destruction) runs with the GIL released
//   (the bindings' call_guard, and ~AioHandle releases it itself when it is held);
// - wait() returns only after each finished op has dropped its tensor, so a caller that reuses or
//   frees a buffer after wait() is the only one holding it.
// [Note: aio errors] No C++ exception crosses the binding for a user error: submit returns a Status
// (code 0 ok, kInvalid: bad argument -> ValueError, kShort: file too short, > 0: errno); failures of
// queued ops are collected and handed to Python after wait(), which raises naming file and offset.
// Strings are built by concatenation, never iostreams (see handle.h).
// [Note: aio any buffer] Like DeepSpeed's handle, any contiguous CPU tensor works at any address,
// size and offset. On an O_DIRECT file each request is planned on its own (plan_request): the part
// whose file offset and length meet the filesystem's alignment goes through O_DIRECT, straight from
// the buffer when its address is aligned, else through a worker's aligned bounce buffer; a
// misaligned file offset, or the tail of a size that is not a multiple of the alignment, goes through
// the page cache on a second, buffered descriptor. The direct part of an odd-sized request ends on a
// page boundary, so the buffered tail never shares a page-cache page with bytes written directly by
// the same request (writeback of such a page could put stale bytes over them). Nothing is truncated:
// every byte of the buffer is read or written, or the op fails naming file and offset. Not ordered:
// two requests in flight at once whose bytes share a page of one file, one moved directly and the
// other through the page cache (the usual Linux caveat on mixing the two); wait() between them.
#pragma once
#include <ATen/ATen.h>
#include <Python.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/magic.h>
#include <pybind11/pybind11.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace z3ext {
namespace aio {

constexpr int kInvalid = -1;  // bad argument (buffer not CPU/contiguous, misaligned for O_DIRECT)
constexpr int kShort = -2;    // the file ends before offset + size (read) / a write made no progress
constexpr int kClosed = -3;   // the handle was closed: nothing can be queued any more
constexpr mode_t kFileMode = 0600;  // new files hold model state: owner only, as DeepSpeed creates them

struct Status {
  int code = 0;
  std::string message;
  std::string notice;  // once per filesystem: which I/O mode was chosen (Python logs it)
};

// How a file is accessed: O_DIRECT with the filesystem's alignment, or through the page cache.
struct Mode {
  bool direct = false;
  int64_t mem_align = 1;
  int64_t offset_align = 1;  // also the size alignment
};

inline std::string errno_text(int e) {
  char buf[256];
  // GNU strerror_r returns a char* that may or may not point into buf.
  const char* s = strerror_r(e, buf, sizeof(buf));
  return std::string(s);
}

inline std::string hex(uintptr_t v) {
  const char* digits = "0123456789abcdef";
  std::string s;
  do {
    s.insert(s.begin(), digits[v & 15]);
    v >>= 4;
  } while (v);
  return "0x" + s;
}

// [Note: O_DIRECT detection] A file is opened with O_DIRECT first. statx(STATX_DIOALIGN) then says
// whether direct I/O really bypasses the cache and what it needs: offset_align 0 means unsupported.
// Filesystems that accept O_DIRECT but report nothing (tmpfs since 6.6, ramfs) are still page cache:
// buffered. Others that report nothing (kernels before 6.1) get the traditional 512-byte rule.
inline Mode detect_mode(int fd, bool opened_direct) {
  Mode m;
  if (!opened_direct) return m;
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) return m;  // devices, pipes: no alignment rules
  struct statx sx;
  std::memset(&sx, 0, sizeof(sx));
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
    if (sx.stx_dio_offset_align == 0) return m;
    m.direct = true;
    m.mem_align = std::max<int64_t>(1, sx.stx_dio_mem_align);
    m.offset_align = sx.stx_dio_offset_align;
    return m;
  }
  struct statfs fs;
  if (fstatfs(fd, &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC)) return m;
  m.direct = true;
  m.mem_align = 512;
  m.offset_align = 512;
  return m;
}

inline std::string fs_name(int fd) {
  struct statfs fs;
  if (fstatfs(fd, &fs) != 0) return "unknown";
  switch (fs.f_type) {
    case TMPFS_MAGIC: return "tmpfs";
    case RAMFS_MAGIC: return "ramfs";
    case EXT4_SUPER_MAGIC: return "ext4";
    case XFS_SUPER_MAGIC: return "xfs";
    case BTRFS_SUPER_MAGIC: return "btrfs";
    case OVERLAYFS_SUPER_MAGIC: return "overlayfs";
    case NFS_SUPER_MAGIC: return "nfs";
    default: return "0x" + hex(static_cast<uintptr_t>(fs.f_type)).substr(2);
  }
}

// Devices whose I/O mode was already reported. Logging only: no per-handle state lives here.
inline bool first_time_on_device(dev_t dev) {
  static std::mutex mu;
  static std::set<dev_t> seen;
  std::lock_guard<std::mutex> lk(mu);
  return seen.insert(dev).second;
}

// Whether this is the process's first request that an O_DIRECT file could not take as is (logging only).
inline bool first_unaligned_request() {
  static std::atomic<bool> seen{false};
  return !seen.exchange(true);
}

// How files of an existing path would be accessed: (direct, memory alignment, offset/size
// alignment, filesystem name); code != 0 when it cannot be opened. For tests and the benchmark.
struct Probe {
  int code = 0;
  std::string message;
  bool direct = false;
  int64_t mem_align = 1;
  int64_t offset_align = 1;
  std::string fs;
};

inline Probe probe(const std::string& path) {
  Probe p;
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  bool opened_direct = fd >= 0;
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    p.code = errno;
    p.message = "z3ext aio: cannot open '" + path + "': " + errno_text(p.code);
    return p;
  }
  Mode m = detect_mode(fd, opened_direct);
  p.direct = m.direct;
  p.mem_align = m.mem_align;
  p.offset_align = m.offset_align;
  p.fs = fs_name(fd);
  ::close(fd);
  return p;
}

// How one chunk of a request is moved ([Note: aio any buffer]).
enum class Via : uint8_t {
  kDirect,    // O_DIRECT from/to the buffer itself (native AIO batches when available)
  kBounce,    // O_DIRECT through the worker's aligned bounce buffer (the buffer's address is misaligned)
  kBuffered,  // through the page cache, on the buffered descriptor
};

struct Op {
  bool read = false;
  int fd = -1;    // O_DIRECT descriptor (direct and bounce chunks); -1 when the op has none
  int bfd = -1;   // page-cache descriptor (buffered chunks); -1 when the op has none
  bool owns_fd = true;   // fd (and bfd when distinct from it) are closed when the op finishes
  bool owns_bfd = true;
  int64_t mem_align = 1;  // of the O_DIRECT descriptor: what a bounce buffer must meet
  char* base = nullptr;
  at::Tensor buffer;  // keeps the storage alive until the op is done; dropped by the worker
  std::string path;
  int64_t file_offset = 0;
  int64_t nbytes = 0;
  std::atomic<int64_t> chunks_left{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  int err = 0;            // errno, or kShort
  int64_t err_offset = -1;  // file offset where it failed
};

struct Chunk {
  std::shared_ptr<Op> op;
  int64_t buf_off = 0;
  int64_t len = 0;
  Via via = Via::kBuffered;
};

// How a request on a file of mode `mode` is split ([Note: aio any buffer]): bytes [0, direct_bytes)
// of the buffer go through O_DIRECT (bounced when the address is misaligned), the rest buffered.
struct Plan {
  int64_t direct_bytes = 0;
  bool bounce = false;
};

inline Plan plan_request(const Mode& mode, uintptr_t addr, int64_t file_offset, int64_t nbytes) {
  Plan p;
  if (!mode.direct || file_offset % mode.offset_align != 0) return p;  // all buffered
  if (nbytes % mode.offset_align == 0) {
    p.direct_bytes = nbytes;
  } else {
    const int64_t page = std::max<int64_t>(sysconf(_SC_PAGESIZE), mode.offset_align);
    p.direct_bytes = std::max<int64_t>((file_offset + nbytes) / page * page - file_offset, 0);
  }
  p.bounce = p.direct_bytes > 0 && addr % static_cast<uintptr_t>(mode.mem_align) != 0;
  return p;
}

// The calling worker's aligned bounce buffers, grown on demand and kept for its next chunks: slot 0
// for one chunk moved synchronously (transfer), slot 1 for the bounced chunks of a native AIO batch
// (a synchronous transfer may run while that batch is in flight).
constexpr int64_t kBounceBatchBytes = 32 << 20;  // at most this much bounced per native AIO batch

inline char* bounce_buffer(int64_t len, int64_t align, int slot = 0) {
  struct Block {
    void* p = nullptr;
    int64_t cap = 0;
    int64_t align = 0;
    ~Block() { free(p); }
  };
  thread_local Block blocks[2];
  Block& b = blocks[slot];
  const int64_t a = std::max<int64_t>(align, sysconf(_SC_PAGESIZE));
  if (b.cap < len || a % std::max<int64_t>(b.align, 1) != 0) {
    free(b.p);
    b.p = nullptr;
    b.cap = 0;
    if (posix_memalign(&b.p, static_cast<size_t>(a), static_cast<size_t>(std::max<int64_t>(len, 1))) != 0) {
      b.p = nullptr;
      return nullptr;
    }
    b.cap = len;
    b.align = a;
  }
  return static_cast<char*>(b.p);
}

// Checks a new_cpu_locked_tensor request before anything is allocated: a negative count, or one
// whose byte size (rounded up to pages) does not fit in int64, is refused naming the size.
inline Status check_locked_size(int64_t numel, int64_t element_size, int64_t page) {
  const std::string what = "z3ext aio: new_cpu_locked_tensor(" + std::to_string(numel) + " elements of " +
                           std::to_string(element_size) + " bytes)";
  if (numel < 0) return Status{kInvalid, what + ": the element count is negative"};
  if (element_size > 0 && numel > (INT64_MAX - page) / element_size)
    return Status{kInvalid, what + ": the size in bytes overflows a 64-bit integer"};
  return Status{};
}

// Page-locked, page-aligned CPU buffers handed out by new_cpu_locked_tensor. Shared with the
// buffers' deleters, so a buffer may outlive its handle.
struct LockedRegistry {
  std::mutex mu;
  std::map<uintptr_t, int64_t> blocks;  // start -> bytes

  bool contains(uintptr_t p) {
    std::lock_guard<std::mutex> lk(mu);
    auto it = blocks.upper_bound(p);
    if (it == blocks.begin()) return false;
    --it;
    return p < it->first + static_cast<uintptr_t>(std::max<int64_t>(it->second, 1));
  }
};

class AioHandle {
 public:
  AioHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
            int64_t intra_op_parallelism)
      : block_size_(block_size),
        queue_depth_(queue_depth),
        single_submit_(single_submit),
        overlap_events_(overlap_events),
        intra_op_(intra_op_parallelism),
        locked_(std::make_shared<LockedRegistry>()) {
    // [Note: aio concurrency] As in DeepSpeed: intra_op_parallelism worker threads, each keeping up
    // to queue_depth requests in flight. For O_DIRECT files a worker takes up to queue_depth chunks
    // (block_size each, in file order) and submits them at once through the kernel's native AIO
    // (io_submit/io_getevents, raw syscalls: no libaio needed); where that is unavailable (io_setup
    // refused) and for buffered files, which native AIO would run synchronously anyway, a worker
    // does one blocking pread/pwrite at a time. Bounced chunks ([Note: aio any buffer]) join the native
    // batches through the worker's bounce buffer (at most kBounceBatchBytes of them per batch). Every op is cut into chunks that all workers take
    // from one queue, so one large op uses every thread.
    // Z3EXT_AIO_BACKEND=pread forces the fallback (tests, and a way out should native AIO misbehave).
    const char* backend = std::getenv("Z3EXT_AIO_BACKEND");
    native_aio_ = !(backend && std::string(backend) == "pread");
    int64_t n = std::max<int64_t>(intra_op_parallelism, 1);
    for (int64_t i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }

  ~AioHandle() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      pybind11::gil_scoped_release release;  // finishing ops may need the GIL (tensor deleters)
      close();
    } else {
      close();
    }
  }

  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  int64_t block_size() const { return block_size_; }
  int64_t queue_depth() const { return queue_depth_; }
  bool single_submit() const { return single_submit_; }
  bool overlap_events() const { return overlap_events_; }
  int64_t intra_op_parallelism() const { return intra_op_; }
  int64_t num_threads() const { return static_cast<int64_t>(threads_.size()); }
  // Whether O_DIRECT chunks go through native AIO (false: forced off, or io_setup refused).
  bool native_aio() const { return native_aio_ && native_aio_ok_.load(); }

  // Queues a read (or write) of the whole of `buffer` at `file_offset` of `path`.
  Status submit(const at::Tensor& buffer, const std::string& path, int64_t file_offset, bool read) {
    const std::string what = std::string(read ? "read of '" : "write of '") + path + "' at offset " +
                             std::to_string(file_offset);
    Status st = check_buffer(buffer, what, file_offset);
    if (st.code) return st;
    if (is_closed()) return closed_status(what);
    int flags = read ? O_RDONLY : (O_WRONLY | O_CREAT);
    int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, kFileMode);
    bool opened_direct = fd >= 0;
    if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags | O_CLOEXEC, kFileMode);
    if (fd < 0) {
      int e = errno;
      return Status{e, "z3ext aio: cannot open for " + what + ": " + errno_text(e)};
    }
    Mode mode = detect_mode(fd, opened_direct);
    if (opened_direct && !mode.direct) {  // accepted O_DIRECT but it means nothing here: reopen plain
      ::close(fd);
      fd = ::open(path.c_str(), flags | O_CLOEXEC, kFileMode);
      if (fd < 0) {
        int e = errno;
        return Status{e, "z3ext aio: cannot open for " + what + ": " + errno_text(e)};
      }
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
      int e = errno;
      ::close(fd);
      return Status{e, "z3ext aio: cannot stat for " + what + ": " + errno_text(e)};
    }
    if (first_time_on_device(sb.st_dev)) {
      st.notice = std::string("z3ext aio: ") + (mode.direct ? "O_DIRECT" : "buffered") + " I/O on " + fs_name(fd) +
                  " (first file: '" + path + "')" +
                  (mode.direct ? ", alignment: memory " + std::to_string(mode.mem_align) + " B, offset/size " +
                                     std::to_string(mode.offset_align) + " B"
                               : "");
    }
    const int64_t nbytes = static_cast<int64_t>(buffer.numel()) * buffer.element_size();
    if (read && S_ISREG(sb.st_mode) && sb.st_size < file_offset + nbytes) {
      ::close(fd);
      st.code = kShort;
      st.message = "z3ext aio: " + what + ": the file has " + std::to_string(sb.st_size) + " bytes, the read needs " +
                   std::to_string(nbytes) + " bytes from offset " + std::to_string(file_offset) + " (up to " +
                   std::to_string(file_offset + nbytes) + ")";
      return st;
    }
    const Plan plan = plan_request(mode, reinterpret_cast<uintptr_t>(buffer.data_ptr()), file_offset, nbytes);
    int dfd = mode.direct ? fd : -1, bfd = mode.direct ? -1 : fd;
    if (mode.direct && plan.direct_bytes < nbytes) {  // a buffered part: a second, page-cache descriptor
      bfd = ::open(path.c_str(), (read ? O_RDONLY : O_WRONLY) | O_CLOEXEC);
      if (bfd < 0) {
        int e = errno;
        ::close(fd);
        return Status{e, "z3ext aio: cannot open (buffered, for the unaligned part) for " + what + ": " + errno_text(e),
                      st.notice};
      }
      if (plan.direct_bytes == 0) {
        ::close(fd);
        dfd = -1;
      }
    }
    if (mode.direct && (plan.bounce || plan.direct_bytes < nbytes) && first_unaligned_request()) {
      st.notice += std::string(st.notice.empty() ? "" : "; ") +
                   "z3ext aio: an unaligned request on an O_DIRECT file ('" + path + "', " + std::to_string(nbytes) +
                   " bytes at offset " + std::to_string(file_offset) +
                   "): misaligned buffers go through an aligned bounce buffer, misaligned offsets and size tails "
                   "through the page cache (logged once)";
    }
    if (!enqueue(buffer, dfd, bfd, /*owns_fds=*/true, path, file_offset, read, mode, plan)) return closed_status(what);
    return st;
  }

  // Queues a write of `buffer` to an already open descriptor (left open).
  Status submit_fd(const at::Tensor& buffer, int fd, int64_t file_offset) {
    const std::string path = "<fd " + std::to_string(fd) + ">";
    const std::string what = "write of '" + path + "' at offset " + std::to_string(file_offset);
    Status st = check_buffer(buffer, what, file_offset);
    if (st.code) return st;
    if (is_closed()) return closed_status(what);
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) {
      int e = errno;
      return Status{e, "z3ext aio: " + what + ": " + errno_text(e)};
    }
    Mode mode = detect_mode(fd, (fl & O_DIRECT) != 0);
    if ((fl & O_DIRECT) && !mode.direct) mode = Mode{true, 1, 1};  // the kernel accepted it as is
    const int64_t nbytes = static_cast<int64_t>(buffer.numel()) * buffer.element_size();
    const Plan plan = plan_request(mode, reinterpret_cast<uintptr_t>(buffer.data_ptr()), file_offset, nbytes);
    if (!mode.direct) {
      if (!enqueue(buffer, -1, fd, /*owns_fds=*/false, path, file_offset, false, mode, plan)) return closed_status(what);
      return st;
    }
    int bfd = -1;
    if (plan.direct_bytes < nbytes) {
      // The caller's descriptor is O_DIRECT and stays as it is: the unaligned part goes through the
      // same file reopened without O_DIRECT (closed by the op).
      const std::string self = "/proc/self/fd/" + std::to_string(fd);
      bfd = ::open(self.c_str(), O_WRONLY | O_CLOEXEC);
      if (bfd < 0) {
        int e = errno;
        return Status{e, "z3ext aio: " + what + ": cannot reopen the descriptor without O_DIRECT for the unaligned "
                         "part: " + errno_text(e)};
      }
    }
    if (!enqueue(buffer, plan.direct_bytes > 0 ? fd : -1, bfd, /*owns_fds=*/false, path, file_offset, false, mode,
                 plan, /*owns_bfd=*/true))
      return closed_status(what);
    return st;
  }

  // Blocks until no op is pending; returns the number of ops completed since the last wait (0 when
  // nothing was pending). Failures are then available from take_errors().
  int64_t wait() {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    int64_t n = completed_;
    completed_ = 0;
    return n;
  }

  // (code, message) of every op that failed since the last call.
  std::vector<std::pair<int, std::string>> take_errors() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::pair<int, std::string>> out;
    out.swap(errors_);
    return out;
  }

  int64_t pending() {
    std::lock_guard<std::mutex> lk(mu_);
    return pending_;
  }

  bool is_closed() {
    std::lock_guard<std::mutex> lk(mu_);
    return stopped_;
  }

  // Finishes pending ops, stops the workers. Idempotent; later submissions fail with kClosed.
  void close() {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (stopped_) return;
      done_cv_.wait(lk, [&] { return pending_ == 0; });
      stopped_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  // A page-aligned, page-locked (best effort: mlock may be refused by RLIMIT_MEMLOCK) CPU tensor.
  // Sizes are checked first (check_locked_size); an undefined tensor with code 0 means out of memory.
  std::pair<Status, at::Tensor> new_locked(int64_t numel, const at::Tensor& example) {
    const int64_t page = sysconf(_SC_PAGESIZE);
    Status st = check_locked_size(numel, example.element_size(), page);
    if (st.code) return {st, at::Tensor()};
    int64_t bytes = std::max<int64_t>(numel * example.element_size(), 1);
    bytes = (bytes + page - 1) / page * page;
    void* p = nullptr;
    if (posix_memalign(&p, static_cast<size_t>(page), static_cast<size_t>(bytes)) != 0) return {st, at::Tensor()};
    bool locked = mlock(p, static_cast<size_t>(bytes)) == 0;
    auto reg = locked_;
    {
      std::lock_guard<std::mutex> lk(reg->mu);
      reg->blocks[reinterpret_cast<uintptr_t>(p)] = bytes;
    }
    auto deleter = [reg, bytes, locked](void* q) {
      {
        std::lock_guard<std::mutex> lk(reg->mu);
        reg->blocks.erase(reinterpret_cast<uintptr_t>(q));
      }
      if (locked) munlock(q, static_cast<size_t>(bytes));
      free(q);
    };
    return {st, at::from_blob(p, {numel}, deleter, example.options().device(at::kCPU).requires_grad(false))};
  }

  bool is_locked(const at::Tensor& t) const {
    return t.defined() && t.device().is_cpu() && locked_->contains(reinterpret_cast<uintptr_t>(t.data_ptr()));
  }

 private:
  static Status check_buffer(const at::Tensor& buffer, const std::string& what, int64_t file_offset) {
    if (!buffer.defined()) return Status{kInvalid, "z3ext aio: " + what + ": the buffer is an undefined tensor"};
    if (!buffer.device().is_cpu())
      return Status{kInvalid, "z3ext aio: " + what + ": the buffer is on " + buffer.device().str() +
                                  "; it must be a CPU tensor"};
    if (!buffer.is_contiguous())
      return Status{kInvalid, "z3ext aio: " + what + ": the buffer (shape " + shape_of(buffer) +
                                  ") is not contiguous; pass .contiguous() or a flat buffer"};
    if (file_offset < 0) return Status{kInvalid, "z3ext aio: " + what + ": negative file offset"};
    return Status{};
  }

  static std::string shape_of(const at::Tensor& t) {
    std::string s = "[";
    for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + "]";
  }

  static Status closed_status(const std::string& what) {
    return Status{kClosed, "z3ext aio: " + what + ": the handle is closed"};
  }

  // False (nothing queued, the op's own descriptors closed) when the handle was closed meanwhile.
  bool enqueue(const at::Tensor& buffer, int fd, int bfd, bool owns_fds, const std::string& path,
               int64_t file_offset, bool read, const Mode& mode, const Plan& plan, bool owns_bfd = false) {
    auto op = std::make_shared<Op>();
    op->read = read;
    op->fd = fd;
    op->bfd = bfd;
    op->owns_fd = owns_fds;
    op->owns_bfd = owns_fds || owns_bfd;
    op->mem_align = mode.mem_align;
    op->base = static_cast<char*>(buffer.data_ptr());
    op->buffer = buffer;
    op->path = path;
    op->file_offset = file_offset;
    op->nbytes = static_cast<int64_t>(buffer.numel()) * buffer.element_size();
    std::vector<Chunk> chunks;
    // The direct part: chunks stay multiples of the O_DIRECT alignment so every transfer is aligned.
    int64_t chunk = std::max<int64_t>(block_size_, 1);
    chunk = (chunk + mode.offset_align - 1) / mode.offset_align * mode.offset_align;
    const Via direct_via = plan.bounce ? Via::kBounce : Via::kDirect;
    for (int64_t off = 0; off < plan.direct_bytes; off += chunk)
      chunks.push_back(Chunk{op, off, std::min(chunk, plan.direct_bytes - off), direct_via});
    // The buffered part. Buffered writes to one file serialise on its inode lock: splitting them
    // across threads only adds contention (measured: half the throughput on tmpfs). One chunk per
    // buffered write.
    const int64_t rest = op->nbytes - plan.direct_bytes;
    const int64_t bchunk = read ? std::max<int64_t>(block_size_, 1) : std::max<int64_t>(rest, 1);
    for (int64_t off = plan.direct_bytes; off < op->nbytes; off += bchunk)
      chunks.push_back(Chunk{op, off, std::min(bchunk, op->nbytes - off), Via::kBuffered});
    op->chunks_left = static_cast<int64_t>(chunks.size());
    std::unique_lock<std::mutex> lk(mu_);
    if (stopped_) {  // close() ran between the caller's check and here: the workers are gone
      lk.unlock();
      chunks.clear();
      if (op->owns_fd && op->fd >= 0) ::close(op->fd);
      if (op->owns_bfd && op->bfd >= 0 && op->bfd != op->fd) ::close(op->bfd);
      return false;
    }
    pending_++;
    if (chunks.empty()) {  // nothing to transfer: done at once
      lk.unlock();
      finish(std::move(op));
      return true;
    }
    for (auto& c : chunks) queue_.push_back(std::move(c));
    lk.unlock();
    if (chunks.size() == 1) work_cv_.notify_one();
    else work_cv_.notify_all();
    return true;
  }

  // One native AIO context per worker thread ([Note: aio concurrency]).
  struct KernelAio {
    aio_context_t ctx = 0;
    bool ok = false;
    explicit KernelAio(int64_t depth) {
      ok = depth > 0 && syscall(SYS_io_setup, static_cast<unsigned>(depth), &ctx) == 0;
    }
    ~KernelAio() {
      if (ok) syscall(SYS_io_destroy, ctx);
    }
  };

  void run() {
    const size_t depth = static_cast<size_t>(std::max<int64_t>(queue_depth_, 1));
    KernelAio kaio(native_aio_ ? static_cast<int64_t>(depth) : 0);
    if (!kaio.ok) native_aio_ok_ = false;
    std::vector<Chunk> batch;
    for (;;) {
      batch.clear();
      {
        std::unique_lock<std::mutex> lk(mu_);
        work_cv_.wait(lk, [&] { return stopped_ || !queue_.empty(); });
        if (queue_.empty()) return;
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
        if (kaio.ok && batch[0].via != Via::kBuffered) {
          int64_t bounced = batch[0].via == Via::kBounce ? batch[0].len : 0;
          while (batch.size() < depth && !queue_.empty() && queue_.front().via != Via::kBuffered) {
            if (queue_.front().via == Via::kBounce) {
              if (bounced + queue_.front().len > kBounceBatchBytes) break;
              bounced += queue_.front().len;
            }
            batch.push_back(std::move(queue_.front()));
            queue_.pop_front();
          }
        }
      }
      if (kaio.ok && batch[0].via != Via::kBuffered) {
        submit_and_wait(kaio, batch);
      } else if (!batch[0].op->failed.load()) {
        transfer(batch[0]);
      }
      for (auto& c : batch) {
        std::shared_ptr<Op> op = std::move(c.op);
        if (op->chunks_left.fetch_sub(1) == 1) finish(std::move(op));
      }
    }
  }

  // Submits the chunks (of ops that have not failed) as one native AIO batch and waits for all of
  // them; a short completion is finished synchronously, a refused submission done synchronously.
  // Bounced chunks (misaligned buffer address) go through slots of the worker's batch bounce buffer.
  static void submit_and_wait(KernelAio& kaio, std::vector<Chunk>& batch) {
    std::vector<struct iocb> cbs(batch.size());
    std::vector<struct iocb*> ptrs;
    std::vector<char*> slots(batch.size(), nullptr);
    int64_t bounce_bytes = 0, bounce_align = 1;
    for (const Chunk& c : batch) {
      if (c.via != Via::kBounce) continue;
      bounce_bytes += (c.len + 4095) / 4096 * 4096;  // page-aligned slots
      bounce_align = std::max(bounce_align, c.op->mem_align);
    }
    char* region = bounce_bytes ? bounce_buffer(bounce_bytes, bounce_align, 1) : nullptr;
    int64_t slot_off = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Chunk& c = batch[i];
      if (c.op->failed.load()) continue;
      char* mem = c.op->base + c.buf_off;
      if (c.via == Via::kBounce) {
        if (region == nullptr) {
          record_error(*c.op, ENOMEM, c.op->file_offset + c.buf_off);
          continue;
        }
        mem = slots[i] = region + slot_off;
        slot_off += (c.len + 4095) / 4096 * 4096;
        if (!c.op->read) std::memcpy(mem, c.op->base + c.buf_off, static_cast<size_t>(c.len));
      }
      struct iocb& cb = cbs[i];
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_data = i;
      cb.aio_fildes = static_cast<uint32_t>(c.op->fd);  // direct and bounced chunks: the O_DIRECT descriptor
      cb.aio_lio_opcode = c.op->read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
      cb.aio_buf = reinterpret_cast<uint64_t>(mem);
      cb.aio_nbytes = static_cast<uint64_t>(c.len);
      cb.aio_offset = c.op->file_offset + c.buf_off;
      ptrs.push_back(&cb);
    }
    size_t submitted = 0;
    while (submitted < ptrs.size()) {
      long r = syscall(SYS_io_submit, kaio.ctx, static_cast<long>(ptrs.size() - submitted), ptrs.data() + submitted);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;  // refused (EAGAIN, EINVAL...): the rest is done synchronously below
      submitted += static_cast<size_t>(r);
    }
    for (size_t k = submitted; k < ptrs.size(); ++k) transfer(batch[ptrs[k]->aio_data]);
    std::vector<struct io_event> events(std::max<size_t>(submitted, 1));
    size_t done = 0;
    while (done < submitted) {
      long r = syscall(SYS_io_getevents, kaio.ctx, 1L, static_cast<long>(submitted - done), events.data(), nullptr);
      if (r < 0) {
        if (errno == EINTR) continue;
        break;  // cannot happen with a valid context; never hang on it
      }
      for (long j = 0; j < r; ++j) {
        const size_t i = events[j].data;
        const Chunk& c = batch[i];
        const int64_t res = events[j].res;
        if (res < 0) {
          record_error(*c.op, static_cast<int>(-res), c.op->file_offset + c.buf_off);
          continue;
        }
        if (slots[i] && c.op->read) std::memcpy(c.op->base + c.buf_off, slots[i], static_cast<size_t>(std::min(res, c.len)));
        if (res < c.len) {  // short: finish the rest the plain way (EOF and ENOSPC surface there)
          transfer(Chunk{c.op, c.buf_off + res, c.len - res, c.via});
        }
      }
      done += static_cast<size_t>(r);
    }
  }

  static void record_error(Op& op, int e, int64_t at) {
    std::lock_guard<std::mutex> lk(op.mu);
    if (!op.err || at < op.err_offset) {
      op.err = e;
      op.err_offset = at;
    }
    op.failed = true;
  }

  // Moves one chunk synchronously: from/to the buffer, or through the bounce buffer.
  static void transfer(const Chunk& c) {
    Op& op = *c.op;
    const int fd = c.via == Via::kBuffered ? op.bfd : op.fd;
    char* bounce = nullptr;
    if (c.via == Via::kBounce) {
      bounce = bounce_buffer(c.len, op.mem_align);
      if (bounce == nullptr) {
        record_error(op, ENOMEM, op.file_offset + c.buf_off);
        return;
      }
      if (!op.read) std::memcpy(bounce, op.base + c.buf_off, static_cast<size_t>(c.len));
    }
    char* const dst = bounce ? bounce : op.base + c.buf_off;
    int64_t done = 0;
    while (done < c.len) {
      char* p = dst + done;
      const size_t n = static_cast<size_t>(c.len - done);
      const off_t at = static_cast<off_t>(op.file_offset + c.buf_off + done);
      ssize_t r = op.read ? ::pread(fd, p, n, at) : ::pwrite(fd, p, n, at);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        record_error(op, r < 0 ? errno : (op.read ? kShort : ENOSPC), at);
        return;
      }
      done += r;
    }
    if (bounce && op.read) std::memcpy(op.base + c.buf_off, bounce, static_cast<size_t>(c.len));
  }

  // Runs on the thread that finished the op's last chunk: closes the file, drops the tensor (its
  // deleter may take the GIL; no lock is held here), then counts the op as complete.
  void finish(std::shared_ptr<Op> op) {
    int close_err = 0;
    if (op->owns_fd && op->fd >= 0 && ::close(op->fd) != 0 && !op->read) close_err = errno;
    if (op->owns_bfd && op->bfd >= 0 && op->bfd != op->fd && ::close(op->bfd) != 0 && !op->read && !close_err)
      close_err = errno;
    op->fd = -1;
    op->bfd = -1;
    op->buffer = at::Tensor();
    std::pair<int, std::string> error{0, ""};
    const std::string what = std::string(op->read ? "read of '" : "write of '") + op->path + "' (" +
                             std::to_string(op->nbytes) + " bytes at offset " + std::to_string(op->file_offset) + ")";
    if (op->err == kShort) {
      error = {kShort, "z3ext aio: " + what + ": end of file at offset " + std::to_string(op->err_offset)};
    } else if (op->err) {
      error = {op->err, "z3ext aio: " + what + " failed at offset " + std::to_string(op->err_offset) + ": " +
                            errno_text(op->err)};
    } else if (close_err) {
      error = {close_err, "z3ext aio: " + what + ": close failed: " + errno_text(close_err)};
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (error.first) errors_.push_back(std::move(error));
      pending_--;
      completed_++;
      if (pending_ == 0) done_cv_.notify_all();
    }
  }

  const int64_t block_size_, queue_depth_;
  const bool single_submit_, overlap_events_;
  const int64_t intra_op_;
  bool native_aio_ = true;
  std::atomic<bool> native_aio_ok_{true};
  std::shared_ptr<LockedRegistry> locked_;

  std::mutex mu_;  // guards everything below
  std::condition_variable work_cv_, done_cv_;
  std::deque<Chunk> queue_;
  int64_t pending_ = 0;    // submitted ops not yet finished
  int64_t completed_ = 0;  // finished since the last wait()
  std::vector<std::pair<int, std::string>> errors_;
  bool stopped_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace aio
}  // namespace z3ext
