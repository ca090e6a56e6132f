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

struct Op {
  bool read = false;
  int fd = -1;
  bool owns_fd = true;
  bool direct = false;  // O_DIRECT: its chunks go through kernel AIO when available
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
};

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
    // does one blocking pread/pwrite at a time. Every op is cut into chunks that all workers take
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
    int flags = read ? O_RDONLY : (O_WRONLY | O_CREAT);
    int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
    bool opened_direct = fd >= 0;
    if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    if (fd < 0) {
      int e = errno;
      return Status{e, "z3ext aio: cannot open for " + what + ": " + errno_text(e)};
    }
    Mode mode = detect_mode(fd, opened_direct);
    if (opened_direct && !mode.direct) {  // accepted O_DIRECT but it means nothing here: reopen plain
      ::close(fd);
      fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
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
    Status a = check_alignment(buffer, mode, what, file_offset, nbytes);
    if (a.code) {
      ::close(fd);
      a.notice = st.notice;
      return a;
    }
    enqueue(buffer, fd, /*owns_fd=*/true, path, file_offset, read, mode);
    return st;
  }

  // Queues a write of `buffer` to an already open descriptor (left open).
  Status submit_fd(const at::Tensor& buffer, int fd, int64_t file_offset) {
    const std::string path = "<fd " + std::to_string(fd) + ">";
    const std::string what = "write of '" + path + "' at offset " + std::to_string(file_offset);
    Status st = check_buffer(buffer, what, file_offset);
    if (st.code) return st;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) {
      int e = errno;
      return Status{e, "z3ext aio: " + what + ": " + errno_text(e)};
    }
    Mode mode = detect_mode(fd, (fl & O_DIRECT) != 0);
    if ((fl & O_DIRECT) && !mode.direct) mode = Mode{true, 1, 1};  // the kernel accepted it as is
    const int64_t nbytes = static_cast<int64_t>(buffer.numel()) * buffer.element_size();
    Status a = check_alignment(buffer, mode, what, file_offset, nbytes);
    if (a.code) return a;
    enqueue(buffer, fd, /*owns_fd=*/false, path, file_offset, false, mode);
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

  // Finishes pending ops, stops the workers. Idempotent.
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
  at::Tensor new_locked(int64_t numel, const at::Tensor& example) {
    const int64_t page = sysconf(_SC_PAGESIZE);
    int64_t bytes = std::max<int64_t>(numel * example.element_size(), 1);
    bytes = (bytes + page - 1) / page * page;
    void* p = nullptr;
    if (posix_memalign(&p, static_cast<size_t>(page), static_cast<size_t>(bytes)) != 0) return at::Tensor();
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
    return at::from_blob(p, {numel}, deleter, example.options().device(at::kCPU).requires_grad(false));
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

  static Status check_alignment(const at::Tensor& buffer, const Mode& mode, const std::string& what,
                                int64_t file_offset, int64_t nbytes) {
    if (!mode.direct) return Status{};
    auto addr = reinterpret_cast<uintptr_t>(buffer.data_ptr());
    std::string bad;
    if (addr % mode.mem_align) bad = "buffer address " + hex(addr) + " is not a multiple of " + std::to_string(mode.mem_align);
    else if (nbytes % mode.offset_align)
      bad = "size " + std::to_string(nbytes) + " bytes is not a multiple of " + std::to_string(mode.offset_align);
    else if (file_offset % mode.offset_align)
      bad = "file offset is not a multiple of " + std::to_string(mode.offset_align);
    if (bad.empty()) return Status{};
    return Status{kInvalid, "z3ext aio: " + what + ": O_DIRECT on this filesystem needs aligned I/O: " + bad +
                                " (allocate with new_cpu_locked_tensor and pad sizes to get_alignment())"};
  }

  void enqueue(const at::Tensor& buffer, int fd, bool owns_fd, const std::string& path, int64_t file_offset,
               bool read, const Mode& mode) {
    auto op = std::make_shared<Op>();
    op->read = read;
    op->fd = fd;
    op->owns_fd = owns_fd;
    op->direct = mode.direct;
    op->base = static_cast<char*>(buffer.data_ptr());
    op->buffer = buffer;
    op->path = path;
    op->file_offset = file_offset;
    op->nbytes = static_cast<int64_t>(buffer.numel()) * buffer.element_size();
    // Chunks stay multiples of the O_DIRECT alignment so every pread/pwrite is aligned.
    int64_t chunk = std::max<int64_t>(block_size_, 1);
    chunk = (chunk + mode.offset_align - 1) / mode.offset_align * mode.offset_align;
    // Buffered writes to one file serialise on its inode lock: splitting them across threads only
    // adds contention (measured: half the throughput on tmpfs). One thread per buffered write op.
    if (!read && !mode.direct) chunk = std::max<int64_t>(op->nbytes, 1);
    std::vector<Chunk> chunks;
    for (int64_t off = 0; off < op->nbytes; off += chunk) chunks.push_back(Chunk{op, off, std::min(chunk, op->nbytes - off)});
    op->chunks_left = static_cast<int64_t>(chunks.size());
    std::unique_lock<std::mutex> lk(mu_);
    pending_++;
    if (chunks.empty()) {  // nothing to transfer: done at once
      lk.unlock();
      finish(std::move(op));
      return;
    }
    for (auto& c : chunks) queue_.push_back(std::move(c));
    lk.unlock();
    if (chunks.size() == 1) work_cv_.notify_one();
    else work_cv_.notify_all();
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
        if (kaio.ok && batch[0].op->direct) {
          while (batch.size() < depth && !queue_.empty() && queue_.front().op->direct) {
            batch.push_back(std::move(queue_.front()));
            queue_.pop_front();
          }
        }
      }
      if (kaio.ok && batch[0].op->direct) {
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
  static void submit_and_wait(KernelAio& kaio, std::vector<Chunk>& batch) {
    std::vector<struct iocb> cbs(batch.size());
    std::vector<struct iocb*> ptrs;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Chunk& c = batch[i];
      if (c.op->failed.load()) continue;
      struct iocb& cb = cbs[i];
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_data = i;
      cb.aio_fildes = static_cast<uint32_t>(c.op->fd);
      cb.aio_lio_opcode = c.op->read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
      cb.aio_buf = reinterpret_cast<uint64_t>(c.op->base + c.buf_off);
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
        const Chunk& c = batch[events[j].data];
        const int64_t res = events[j].res;
        if (res < 0) {
          record_error(*c.op, static_cast<int>(-res), c.op->file_offset + c.buf_off);
        } else if (res < c.len) {  // short: finish the rest the plain way (EOF and ENOSPC surface there)
          transfer(Chunk{c.op, c.buf_off + res, c.len - res});
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

  static void transfer(const Chunk& c) {
    Op& op = *c.op;
    int64_t done = 0;
    while (done < c.len) {
      char* p = op.base + c.buf_off + done;
      const size_t n = static_cast<size_t>(c.len - done);
      const off_t at = static_cast<off_t>(op.file_offset + c.buf_off + done);
      ssize_t r = op.read ? ::pread(op.fd, p, n, at) : ::pwrite(op.fd, p, n, at);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        record_error(op, r < 0 ? errno : (op.read ? kShort : ENOSPC), at);
        return;
      }
      done += r;
    }
  }

  // Runs on the thread that finished the op's last chunk: closes the file, drops the tensor (its
  // deleter may take the GIL; no lock is held here), then counts the op as complete.
  void finish(std::shared_ptr<Op> op) {
    int close_err = 0;
    if (op->owns_fd && op->fd >= 0 && ::close(op->fd) != 0 && !op->read) close_err = errno;
    op->fd = -1;
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
