"""outcore.aio: the outcore io_uring engine on CPU torch tensors, shaped like DeepNVMe.

A DeepNVMe script changes its import:

    # h = AsyncIOBuilder().load().aio_handle(block_size, queue_depth, single_submit,
    #                                         overlap_events, intra_op_parallelism)
    from outcore.aio import aio_handle
    h = aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)

`Handle` (keyword arguments in the order of this project's API) and `aio_handle` (DeepNVMe's
positional order) make the same object. The tensor must be a contiguous CPU tensor. The GIL is
released while waiting for I/O.

Memory: a synchronous transfer, and an asynchronous one on memory from this handle's
new_pinned_tensor, reads or writes the tensor's memory in place (no copy) and holds the tensor's
storage until it completes (a pinned tensor's storage cannot be resized; no other thread may
resize_() the tensor of a synchronous call while it runs). An asynchronous request on any other
tensor, whose storage a resize_() could reallocate, goes through a private 4096-aligned buffer
of its size: a write copies the tensor's bytes when queued; a read, when waited (Request.wait()
or Handle.wait()), stores its bytes into the storage the tensor had when queued, held alive and
followed where resize_() reallocated it (a read never waited before its Handle is gone stores
nothing; one whose storage was shrunk below it raises ValueError and stores nothing). So a
tensor deleted, set_() to other memory or resize_()d before its request is waited never makes
the request touch freed memory. A KeyboardInterrupt while a read is stored leaves the request
pending: the next wait stores it.

Files: each request holds its file open until it is waited, so more asynchronous requests
queued at once than the process may open files (`ulimit -n`) fail with outcore.IoError EMFILE
(the others are unaffected); wait for some first.

Processes: a Handle works in the process that made it. A forked child (a DataLoader worker, a
multiprocessing pool) has its memory but not its I/O threads: there a request raises
outcore.Error saying so (make a new Handle in the child), and the child's copy goes away without
waiting for those threads.

Where outcore differs from DeepNVMe:
  * Defaults: queue_depth=32 and overlap_events=True (DeepNVMe: 128 and False).
  * O_DIRECT: with o_direct="auto" (the default), a request uses O_DIRECT when the address of
    the memory it transfers (the tensor's, or its aligned private buffer's), the file offset
    and the byte length are all multiples of get_alignment() (4096), and the page cache
    otherwise, so any size at any offset works. o_direct="always" refuses a misaligned request
    with InvalidArgument (nothing is queued); "never" always buffers.
    Filesystems that refuse O_DIRECT (tmpfs) fall back to buffered I/O with one warning.
  * async_pread / async_pwrite (and pread / pwrite with async_op=True) return a Request,
    whose wait() completes that request alone; Handle.wait() still completes all of them.
  * Errors raise instead of returning -1: outcore.IoError (an OSError carrying errno,
    filename, offset and length) for a missing file, a read past the end of the file, EIO or
    ENOSPC; ValueError for a tensor that is not a contiguous (strided) CPU tensor (naming the
    file and offset), a path holding a null byte (as open() does) and a size or offset out of
    range, and for an asynchronous read into read-only memory (a tensor over a read-only
    mapping; a synchronous one raises IoError EFAULT); TypeError for an offset or size that is
    not an integer (a float or a str is neither
    rounded nor parsed); outcore.CorruptDataError when validate=True finds a mismatch.
  * A failed read stores nothing into the tensor, except an asynchronous read into this
    handle's pinned memory (read in place), which may have stored the bytes before the failing
    piece. (A synchronous read past the end of a file is refused before it reads; one whose
    file is truncated while it runs may store the bytes before the new end.)
  * Writes create a missing file (mode 0666 less the umask, as open() does) and never truncate
    it. A write that fails removes the file it created, unless another write (of any handle in
    the process) opened it meanwhile; a file that existed before is never removed.
  * new_pinned_tensor(numel, dtype) returns page-locked (mlock), 4096-aligned memory that is
    freed when the tensor and every view of it are gone (numel 0: an empty tensor, no memory);
    free_pinned_tensor only makes the handle forget it (new_cpu_locked_tensor /
    free_cpu_locked_tensor are aliases).
  * Files are named by path (str, bytes or os.PathLike), never by an open file descriptor: the
    descriptor forms some DeepNVMe versions accept raise TypeError here.
"""
import os
import sys
import weakref

import torch

from . import _args
from . import _outcore
from ._outcore import CorruptDataError

__all__ = ["Handle", "aio_handle", "Request", "aio_read", "aio_write", "pinned_bytes",
           "pinned_buffers"]

_ALIGNMENT = _outcore.io_alignment()
_MAX_OFFSET = 2**63 - 1  # the largest file offset (off_t)
_MAX_PINNED_BYTES = sys.maxsize  # what torch.frombuffer and the buffer protocol can view


def pinned_bytes():
    """Bytes of pinned memory from new_pinned_tensor still alive in this process."""
    return _outcore.pinned_bytes()


def pinned_buffers():
    """Pinned buffers from new_pinned_tensor still alive in this process."""
    return _outcore.pinned_buffers()


def _check_tensor(buffer, filename, offset):
    """(address, nbytes) of a contiguous CPU tensor, or ValueError naming file and offset."""
    where = f"{filename}: offset {offset}"
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{where}: buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.layout != torch.strided:
        raise ValueError(f"{where}: buffer must be a dense (strided) tensor, got {buffer.layout}")
    if buffer.device.type != "cpu":
        raise ValueError(f"{where}: buffer must be a CPU tensor, got one on {buffer.device}")
    if not buffer.is_contiguous():
        raise ValueError(f"{where}: buffer must be contiguous (call .contiguous() first)")
    if buffer.is_conj() or buffer.is_neg():  # its bytes are not its values
        raise ValueError(f"{where}: buffer is a conjugate or negative view (call "
                         ".resolve_conj().resolve_neg() first)")
    if not 0 <= offset <= _MAX_OFFSET:
        raise ValueError(f"{where}: the file offset must be in 0..{_MAX_OFFSET}")
    return buffer.data_ptr(), buffer.numel() * buffer.element_size()


def _writable(address, nbytes):
    """Whether the nbytes at address lie in writable mappings of this process, from
    /proc/self/maps (True where it cannot be read: the kernel's EFAULT is then the check)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read()
    except OSError:
        return True
    at, end = address, address + nbytes
    for line in maps.splitlines():  # in address order
        span, perms = line.split(b" ", 2)[:2]
        low, high = (int(x, 16) for x in span.split(b"-"))
        if high <= at:
            continue
        if low > at or perms[1:2] != b"w":  # a hole, or read-only memory
            return False
        at = high
        if at >= end:
            return True
    return False


def _untyped_storage(tensor):
    """The storage under `tensor` (untyped_storage() from torch 2.0, storage().untyped() before)."""
    if hasattr(tensor, "untyped_storage"):
        return tensor.untyped_storage()
    return tensor.storage().untyped()


def _byte_view(tensor, nbytes):
    """A uint8 tensor over the first nbytes of `tensor`'s memory that shares its storage: it keeps
    that storage alive after `tensor` is deleted or set_() to another, and follows it when a
    resize_() reallocates it."""
    view = torch.empty(0, dtype=torch.uint8)
    return view.set_(_untyped_storage(tensor), tensor.storage_offset() * tensor.element_size(),
                     (nbytes,))


def _aligned_bytes(nbytes):
    """nbytes of fresh uint8 memory at a multiple of the I/O alignment (O_DIRECT-capable)."""
    raw = torch.empty(nbytes + _ALIGNMENT - 1, dtype=torch.uint8)
    skip = -raw.data_ptr() % _ALIGNMENT
    return raw[skip:skip + nbytes]


def _store(data, target, filename, offset):
    """Copies a completed read from the private buffer `data` into `target` (a _byte_view of the
    caller's tensor). ValueError, storing nothing, if target's storage no longer holds it."""
    have = _untyped_storage(target).nbytes() - target.storage_offset()
    if have < data.numel():
        raise ValueError(f"{filename}: offset {offset}: the tensor's storage was resized to "
                         f"{max(have, 0)} bytes from its start while the {data.numel()}-byte "
                         "read was in flight; the data read was not stored")
    target.copy_(data)


class Request:
    """One queued pread or pwrite. Holds the memory it transfers until it completes."""

    def __init__(self, handle, request_id, filename, offset):
        self._handle = handle
        self._id = request_id
        self.filename = filename
        self.offset = offset

    def wait(self):
        """Blocks until this request completes; returns 1, or 0 if it was already waited (by
        this method or Handle.wait()). Raises the request's error (with validate=True, a
        CorruptDataError when the file does not hold the buffer's bytes). A read through a
        private buffer (see the module docstring) stores its bytes into the tensor here."""
        return 1 if self._handle._core.wait(self._id) else 0

    def done(self):
        """True when wait() would not block."""
        return self._handle._core.done(self._id)


class Handle:
    """An outcore aio engine: intra_op_parallelism I/O threads, each with an io_uring of
    queue_depth entries, moving block_size pieces. See the module docstring for how it
    differs from DeepNVMe's aio_handle."""

    def __init__(self, block_size=1048576, queue_depth=32, intra_op_parallelism=1,
                 single_submit=False, overlap_events=True, *, o_direct="auto", _faults=()):
        # _faults: [(kind, nth, every, direction)], injected I/O faults for tests only.
        # The ranges are aio::validate's (aio/aio.hpp, Options).
        allowed = f"a multiple of {_ALIGNMENT} in {_ALIGNMENT}..{1 << 30}"
        block_size = _args.integer(block_size, "block_size", _ALIGNMENT, 1 << 30, allowed)
        if block_size % _ALIGNMENT:
            raise ValueError(f"block_size: got {block_size}; allowed: {allowed}")
        queue_depth = _args.integer(queue_depth, "queue_depth", 1, 4096)
        threads = _args.integer(intra_op_parallelism, "intra_op_parallelism", 1, 256)
        self._core = _outcore.AioHandle(block_size, queue_depth, threads, bool(single_submit),
                                        bool(overlap_events), str(o_direct), list(_faults))
        # data_ptr -> the PinnedMemory of a tensor this handle handed out, held weakly: the
        # tensor and its views hold the memory, the handle only finds it (an entry goes with it;
        # the dictionary removes only a dead entry, never one a new memory at the same address
        # took).
        self._pinned = weakref.WeakValueDictionary()

    # -- getters (DeepNVMe names) --
    def get_block_size(self):
        return self._core.block_size

    def get_queue_depth(self):
        return self._core.queue_depth

    def get_single_submit(self):
        return self._core.single_submit

    def get_overlap_events(self):
        return self._core.overlap_events

    def get_intra_op_parallelism(self):
        return self._core.threads

    def get_thread_count(self):
        return self._core.threads

    def get_alignment(self):
        return _ALIGNMENT

    def backend(self):
        """"io_uring", or "sync" where io_uring is unavailable (see aio/aio.hpp)."""
        return self._core.backend()

    # -- I/O --
    def _submit(self, write, buffer, filename, offset, validate, async_op):
        address, nbytes = _check_tensor(buffer, filename, offset)
        # `memory`: the bytes the I/O moves; the engine holds it, and so its storage, until the
        # request is waited.
        memory, on_complete = _byte_view(buffer, nbytes), None
        if async_op and nbytes > 0 and self._pinned_memory_at(address) is None:
            # A storage the caller can resize_() (torch reallocates it): transfer through a
            # private buffer that nothing else can reach.
            target, memory = memory, _aligned_bytes(nbytes)
            if write:
                memory.copy_(target)
            elif not _writable(address, nbytes):
                # Stored at the wait by a copy that would fault (the synchronous read's kernel
                # says EFAULT instead).
                raise ValueError(f"{filename}: offset {offset}: buffer's memory is read-only "
                                 "(a tensor over a read-only mapping): a read cannot store "
                                 "into it")
            else:
                on_complete = lambda: _store(memory, target, filename, offset)  # noqa: E731
        if validate:
            # Run by whichever wait completes the request (Request.wait or Handle.wait): its
            # CorruptDataError is that wait's error.
            store = on_complete

            def on_complete():
                if store is not None:
                    store()
                _validate(memory, filename, offset)
        # A synchronous read is in place: the core refuses one past the end of the file before
        # it stores any byte.
        # The bytes of the name (a str from os.listdir may hold undecodable bytes as surrogates).
        request_id = self._core.submit(write, memory, memory.data_ptr(), nbytes,
                                       os.fsencode(filename), offset, on_complete, not async_op)
        return Request(self, request_id, filename, offset)

    def _run(self, write, buffer, filename, validate, async_op, file_offset, offset):
        filename = _args.path(filename, "filename")
        # DeepNVMe's order puts validate and async before the offset: an offset given as the
        # third positional argument would silently be taken as validate.
        for name, value in (("validate", validate), ("async_op", async_op)):
            if not isinstance(value, bool):
                raise TypeError(f"{filename}: {name} must be a bool, got "
                                f"{value!r}; pass the file offset as offset= or file_offset=")
        if offset is not None and file_offset != 0:
            raise TypeError(f"{filename}: file_offset={file_offset!r} and offset={offset!r} both "
                            "given; pass one of them")
        name, value = ("file_offset", file_offset) if offset is None else ("offset", offset)
        file_offset = _args.integer(value, f"{filename}: {name}")
        req = self._submit(write, buffer, filename, file_offset, validate, async_op)
        if async_op:
            return req
        return req.wait()

    def pread(self, buffer, filename, validate=False, async_op=False, file_offset=0, *,
              offset=None):
        """Reads len(buffer) bytes of `filename` at file_offset (or offset=) into buffer.
        Synchronous: returns 1 once done. async_op=True: returns a Request at once (DeepNVMe
        returns 0 there). Raises outcore.IoError (errno, filename, offset set) on failure,
        including a file shorter than file_offset + buffer's size in bytes."""
        return self._run(False, buffer, filename, validate, async_op, file_offset, offset)

    def pwrite(self, buffer, filename, validate=False, async_op=False, file_offset=0, *,
               offset=None):
        """Writes buffer's bytes to `filename` at file_offset (or offset=); creates the file
        if missing, never truncates it. Returns as pread does."""
        return self._run(True, buffer, filename, validate, async_op, file_offset, offset)

    def read(self, buffer, filename, validate=False, file_offset=0, *, offset=None):
        """Synchronous pread (DeepNVMe's single-threaded read; here the same engine)."""
        return self._run(False, buffer, filename, validate, False, file_offset, offset)

    def write(self, buffer, filename, validate=False, file_offset=0, *, offset=None):
        """Synchronous pwrite."""
        return self._run(True, buffer, filename, validate, False, file_offset, offset)

    def sync_pread(self, buffer, filename, file_offset=0, *, offset=None):
        return self._run(False, buffer, filename, False, False, file_offset, offset)

    def sync_pwrite(self, buffer, filename, file_offset=0, *, offset=None):
        return self._run(True, buffer, filename, False, False, file_offset, offset)

    def async_pread(self, buffer, filename, file_offset=0, *, offset=None):
        """Queues a read and returns its Request. The bytes are in buffer's storage once it is
        waited (in place for this handle's pinned tensors, else stored at the wait)."""
        return self._run(False, buffer, filename, False, True, file_offset, offset)

    def async_pwrite(self, buffer, filename, file_offset=0, *, offset=None):
        """Queues a write and returns its Request. A pinned tensor of this handle is written in
        place and must not change until the request is done; any other tensor's bytes are
        copied here and it may change at once."""
        return self._run(True, buffer, filename, False, True, file_offset, offset)

    def wait(self):
        """Blocks until every queued request completes; returns how many did. If any failed
        (a validate=True request among them, when the file does not hold its bytes), raises the
        error of the oldest failed one after all are done. Reads through a private buffer store
        their bytes into their tensors here."""
        return self._core.wait_all()

    def pending(self):
        """Requests queued and not yet waited."""
        return self._core.pending()

    # -- pinned memory --
    def new_pinned_tensor(self, numel, dtype=torch.float32):
        """A 1-D tensor of numel elements of dtype in page-locked, 4096-aligned memory (zero
        filled is not guaranteed). Its memory is freed when the tensor and all views of it
        are gone; numel 0 gives an empty tensor that holds none. Raises ValueError for a numel
        below 0 or beyond what a tensor can view, outcore.OutOfMemoryError if it cannot be
        allocated."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"new_pinned_tensor: dtype must be a torch.dtype, got {dtype!r}")
        element_size = torch.empty((), dtype=dtype).element_size()
        most = _MAX_PINNED_BYTES // element_size
        numel = _args.integer(numel, "numel", 0, most, f"0..{most} elements of {dtype}")
        if numel == 0:
            return torch.empty(0, dtype=dtype)  # no memory to pin (nor to free)
        memory = _outcore.PinnedMemory(numel * element_size)
        tensor = torch.frombuffer(memory, dtype=torch.uint8, count=memory.nbytes).view(dtype)
        self._pinned[tensor.data_ptr()] = memory
        return tensor

    def free_pinned_tensor(self, tensor):
        """Makes this handle forget a tensor from new_pinned_tensor (is_pinned is then False;
        the memory goes when the last tensor viewing it does, with or without this call).
        Returns True; ValueError for any other tensor."""
        _check_is_tensor(tensor, "free_pinned_tensor")
        if tensor.numel() == 0:
            return True
        if self._pinned.pop(tensor.data_ptr(), None) is None:
            raise ValueError("free_pinned_tensor: not a tensor from this handle's "
                             "new_pinned_tensor (or already freed)")
        return True

    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        """DeepNVMe's name: new_pinned_tensor(num_elem, example_tensor.dtype)."""
        _check_is_tensor(example_tensor, "new_cpu_locked_tensor")
        return self.new_pinned_tensor(num_elem, example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor):
        return self.free_pinned_tensor(tensor)

    def is_pinned(self, tensor):
        """True for a tensor inside memory from new_pinned_tensor of this handle."""
        _check_is_tensor(tensor, "is_pinned")
        return self._pinned_memory_at(tensor.data_ptr()) is not None

    def _pinned_memory_at(self, address):
        """The PinnedMemory of this handle (not freed) holding `address`, or None."""
        for start, memory in list(self._pinned.items()):
            if start <= address < start + memory.nbytes:
                return memory
        return None


def _check_is_tensor(value, what):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(value).__name__}")


def aio_handle(block_size=1048576, queue_depth=32, single_submit=False, overlap_events=True,
               intra_op_parallelism=1):
    """A Handle with DeepNVMe's positional argument order (outcore's defaults)."""
    return Handle(block_size, queue_depth, intra_op_parallelism, single_submit, overlap_events)


def _validate(buffer, filename, offset):
    """Compares buffer with the file's bytes at offset (read through the page cache)."""
    nbytes = buffer.numel() * buffer.element_size()
    with open(filename, "rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
    mine = buffer.view(torch.uint8).reshape(-1).numpy().tobytes() if nbytes else b""
    if data != mine:
        raise CorruptDataError(f"{filename}: offset {offset}: validate: the {nbytes} bytes in "
                               "the file differ from the buffer")


def aio_read(buffer, filename, block_size=1048576, queue_depth=32, single_submit=False,
             overlap_events=True, validate=False):
    """One synchronous read with a temporary Handle (DeepNVMe's module-level aio_read)."""
    return Handle(block_size, queue_depth, 1, single_submit, overlap_events).read(
        buffer, filename, validate)


def aio_write(buffer, filename, block_size=1048576, queue_depth=32, single_submit=False,
              overlap_events=True, validate=False):
    """One synchronous write with a temporary Handle (DeepNVMe's module-level aio_write)."""
    return Handle(block_size, queue_depth, 1, single_submit, overlap_events).write(
        buffer, filename, validate)
