"""outcore.aio.Handle on real files: round trips of odd sizes at odd offsets (page cache) and
aligned ones (O_DIRECT), overlapping async requests, pinned tensors, every error path raising
the right exception with the file and offset, the GIL released while blocked, async requests
whose tensor is freed, set_() or resize_()d before wait() touching no freed memory, and no file
descriptor or pinned buffer leaked over 1000 calls."""
import errno
import gc
import mmap
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import warnings

from oracle import import_torch_and_outcore

torch, outcore = import_torch_and_outcore()
aio = outcore.aio


def random_tensor(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def file_bytes(path, offset, nbytes):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def as_bytes(t):
    return t.view(torch.uint8).numpy().tobytes()


def open_fds():
    return len(os.listdir("/proc/self/fd"))


class AioTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="outcore_py_aio_")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)


class RoundTrip(AioTest):
    def test_odd_sizes_at_odd_offsets(self):
        h = aio.Handle(block_size=65536, queue_depth=8, intra_op_parallelism=2)
        path = self.path("odd.bin")
        cases = [(1, torch.uint8, 0), (7, torch.float32, 1), (4095, torch.uint8, 4093),
                 (4097, torch.float16, 12345), (300007, torch.float32, 4096 * 3 + 5),
                 (65537, torch.int64, 1 << 20)]
        for seed, (numel, dtype, offset) in enumerate(cases):
            src = random_tensor(numel, dtype, seed)
            self.assertEqual(h.pwrite(src, path, file_offset=offset), 1)
            self.assertEqual(file_bytes(path, offset, len(as_bytes(src))), as_bytes(src),
                             f"{numel} x {dtype} at {offset}: file bytes")
            dst = torch.zeros_like(src)
            self.assertEqual(h.pread(dst, path, offset=offset), 1)
            self.assertTrue(torch.equal(dst.view(torch.uint8), src.view(torch.uint8)),
                            f"{numel} x {dtype} at {offset}: read back")

    def test_aligned_pinned_tensors_use_o_direct(self):
        h = aio.Handle(o_direct="always")  # a misaligned request would be refused
        path = self.path("direct.bin")
        src = h.new_pinned_tensor(3 << 18, torch.float32)  # 3 MiB
        self.assertEqual(src.data_ptr() % h.get_alignment(), 0)
        self.assertTrue(h.is_pinned(src))
        src.copy_(random_tensor(3 << 18, torch.float32, 1))
        dst = h.new_pinned_tensor(3 << 18, torch.float32)
        h.sync_pwrite(src, path, 8192)
        h.sync_pread(dst, path, 8192)
        self.assertEqual(as_bytes(src), as_bytes(dst))
        self.assertEqual(file_bytes(path, 8192, 16), as_bytes(src[:4]))
        self.assertTrue(h.free_pinned_tensor(src))
        self.assertTrue(h.free_pinned_tensor(dst))

    def test_a_name_that_is_not_utf8(self):
        # A str from os.listdir holds the bytes of such a name as surrogates: written and read
        # back, and an error names it (IoError, not UnicodeDecodeError).
        odd = os.fsdecode(os.path.join(os.fsencode(self.dir), b"\xfe.bin"))
        data = torch.arange(4096).remainder(251).to(torch.uint8)
        h = aio.Handle()
        self.assertEqual(h.pwrite(data, odd), 1)
        back = torch.zeros_like(data)
        self.assertEqual(h.pread(back, odd), 1)
        self.assertTrue(torch.equal(back, data))
        with self.assertRaises(OSError) as cm:
            h.pread(torch.zeros(8192, dtype=torch.uint8), odd)  # past its end
        self.assertEqual(cm.exception.filename, odd)

    def test_a_new_file_has_the_mode_open_gives(self):
        # 0666 less the umask, as Python's open() and torch.save make a file (the run's own swap
        # files are 0600: those are not a user's).
        old = os.umask(0o022)
        try:
            writes = (("sync.bin", lambda h, p: h.pwrite(torch.ones(8), p)),
                      ("async.bin", lambda h, p: h.async_pwrite(torch.ones(8), p).wait()))
            for name, write in writes:
                path = self.path(name)
                write(aio.Handle(), path)
                self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o644, name)
        finally:
            os.umask(old)

    def test_a_write_creates_the_target_of_a_dangling_symlink(self):
        link, target = self.path("link.bin"), self.path("target.bin")
        os.symlink(target, link)
        self.assertEqual(aio.Handle().pwrite(torch.ones(4, dtype=torch.uint8), link), 1)
        self.assertEqual(file_bytes(target, 0, 10), b"\x01" * 4)

    def test_validate_compares_the_file(self):
        h = aio.Handle()
        path = self.path("v.bin")
        src = random_tensor(1000, torch.float32, 3)
        self.assertEqual(h.write(src, path, True), 1)
        self.assertEqual(h.read(torch.empty(1000), path, True), 1)


class Async(AioTest):
    def test_validate_runs_at_whichever_wait_completes_the_request(self):
        # The file changes after the read's I/O and before its wait: the wait's validation finds
        # the buffer and the file apart, whether Request.wait or Handle.wait completes it.
        for finish in ("request", "handle"):
            with self.subTest(finish=finish):
                h = aio.Handle()
                path = self.path(f"validated_{finish}.bin")
                h.pwrite(torch.full((4096,), 7, dtype=torch.uint8), path)
                r = h.pread(torch.zeros(4096, dtype=torch.uint8), path, validate=True,
                            async_op=True)
                while not r.done():
                    time.sleep(0.001)
                with open(path, "r+b") as f:
                    f.write(b"\x09")
                with self.assertRaisesRegex(outcore.CorruptDataError,
                                            "offset 0: validate: the 4096 bytes"):
                    r.wait() if finish == "request" else h.wait()
                self.assertEqual(r.wait(), 0)  # released by the wait that raised
                self.assertEqual(h.pending(), 0)

    def test_overlapping_requests_complete_and_keep_tensors_alive(self):
        h = aio.Handle(block_size=4096, queue_depth=4)
        path = self.path("async.bin")
        parts = [random_tensor(10000 + 4096 * i, torch.uint8, i) for i in range(8)]
        offsets = [sum(p.numel() for p in parts[:i]) for i in range(8)]
        requests = [h.async_pwrite(p.clone(), path, o) for p, o in zip(parts, offsets)]
        # The clones passed above have no other reference: the handle keeps them alive.
        self.assertEqual(h.pending(), 8)
        self.assertEqual(h.wait(), 8)
        self.assertEqual(h.pending(), 0)
        self.assertEqual(requests[0].wait(), 0)  # already completed by h.wait()
        outs = [torch.zeros_like(p) for p in parts]
        reads = [h.pread(d, path, False, True, o) for d, o in zip(outs, offsets)]
        self.assertEqual(h.pending(), 8)
        for r in reversed(reads):  # completed one by one, in any order
            self.assertEqual(r.wait(), 1)
            self.assertTrue(r.done())
        for p, d in zip(parts, outs):
            self.assertTrue(torch.equal(p, d))

    def test_async_reads_land_in_place_in_pinned_tensors_and_at_wait_in_others(self):
        h = aio.Handle(block_size=4096)
        path = self.path("where.bin")
        src = random_tensor(3 * 4096, torch.uint8, 9)
        h.pwrite(src, path)
        pinned = h.new_pinned_tensor(src.numel(), torch.uint8)
        pinned.zero_()
        other = torch.zeros_like(src)
        reqs = [h.async_pread(pinned, path), h.async_pread(other, path)]
        while not all(r.done() for r in reqs):
            time.sleep(0.001)
        self.assertTrue(torch.equal(pinned, src), "pinned: read in place, before wait()")
        self.assertEqual(int(other.count_nonzero()), 0, "other: stored at wait(), not before")
        self.assertEqual(h.wait(), 2)
        self.assertTrue(torch.equal(other, src))
        # A write takes the bytes a non-pinned tensor has when it is queued.
        queued = src.clone()
        w = h.async_pwrite(queued, path, offset=src.numel())
        queued.zero_()
        self.assertEqual(w.wait(), 1)
        self.assertEqual(file_bytes(path, src.numel(), src.numel()), as_bytes(src))
        h.free_pinned_tensor(pinned)

    def test_gil_is_released_while_blocked(self):
        # A synchronous read of 256 pieces, one in flight, each completing 1 ms late: while
        # the reader thread waits in the binding, this thread (which needs the GIL) must keep
        # running and see the request pending; if the binding held the GIL while blocked in
        # wait, it would see nothing until the read was over.
        path = self.path("slow.bin")
        data = torch.arange(1 << 20).remainder(253).to(torch.uint8)
        aio.Handle().pwrite(data, path)
        h = aio.Handle(block_size=4096, queue_depth=1, _faults=[("delay", 1, 1, -1)])
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        errors = []

        def reader():
            try:
                h.pread(dst, path)
            except Exception as e:  # reported below
                errors.append(e)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        seen_pending = 0
        while t.is_alive():
            seen_pending += h.pending() > 0
            time.sleep(0.001)
        t.join(60)
        self.assertEqual(errors, [])
        self.assertGreater(seen_pending, 10)
        self.assertTrue(torch.equal(dst, data))

    def test_a_wait_in_another_thread_never_ends_a_request_early(self):
        # Each request in 16 pieces, one in flight, each 1 ms late. Another thread calling
        # Handle.wait() in a loop must not take a synchronous request from its caller (which
        # would then return, or miss its error, while the I/O runs), and a request another
        # thread waits for is neither done() nor waited (Handle.wait(), Request.wait()) before
        # that wait has ended.
        path = self.path("race.bin")
        data = torch.arange(1 << 16).remainder(251).add(1).to(torch.uint8)
        h = aio.Handle(block_size=4096, queue_depth=1, _faults=[("delay", 1, 1, -1)])
        stop = threading.Event()
        errors = []

        def waiter():
            while not stop.is_set():
                try:
                    h.wait()
                except Exception as e:  # a synchronous request's error, taken from its caller
                    errors.append(e)

        t = threading.Thread(target=waiter, daemon=True)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the GIL changes hands between submit and wait
        t.start()
        try:
            for _ in range(10):
                src = data.clone()
                self.assertEqual(h.pwrite(src, path), 1)
                src.zero_()  # the caller may reuse its buffer once pwrite returned
                dst = torch.zeros_like(data)
                self.assertEqual(h.pread(dst, path), 1)
                self.assertTrue(torch.equal(dst, data))
            # A failing synchronous write raises in its caller, not in the other thread.
            failing = aio.Handle(block_size=4096, queue_depth=1,
                                 _faults=[("eio", 1, 1, 1), ("delay", 1, 1, -1)])
            for _ in range(5):
                with self.assertRaises(OSError):
                    failing.pwrite(data.clone(), self.path("fail.bin"))
        finally:
            stop.set()
            t.join(60)
            sys.setswitchinterval(switch)
        self.assertEqual(errors, [])
        # An asynchronous read (256 pieces: at least 256 ms) waited in one thread: not done in
        # another, whose Handle.wait() returns only once the bytes are there.
        big = torch.arange(1 << 20).remainder(249).add(1).to(torch.uint8)
        aio.Handle().pwrite(big, self.path("big.bin"))
        dst = torch.zeros_like(big)
        req = h.async_pread(dst, self.path("big.bin"))
        first = {}
        reader = threading.Thread(target=lambda: first.update(n=req.wait()), daemon=True)
        reader.start()
        time.sleep(0.05)
        self.assertFalse(req.done())
        waited = h.wait()  # this request: the reader's wait's end, or its own
        self.assertTrue(torch.equal(dst, big))
        reader.join(60)
        self.assertEqual(waited + first.get("n", -1), 1)
        self.assertEqual(req.wait(), 0)


# Run in a child process (a write into freed memory may crash it): argv is the directory of
# oracle.py, "read" or "write", the mutation, a scratch file. Queues one async request of 64 KiB
# in 16 pieces, one in flight, each completing 1 ms late, so most pieces move after the
# mutation; then allocates tensors of the same size filled with a sentinel (the allocator hands
# them the memory the mutation freed), waits, and checks that no sentinel changed and that the
# data went where it should. Prints what went wrong and exits 1, or exits 0.
STORAGE_LOST_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from oracle import import_torch_and_outcore
torch, outcore = import_torch_and_outcore()
direction, mutation, path = sys.argv[2:5]
N = 1 << 16
data = torch.arange(N).remainder(251).to(torch.uint8)  # never all 0xAB
outcore.aio.Handle().pwrite(data if direction == "read" else torch.zeros(N, dtype=torch.uint8),
                            path)
h = outcore.aio.Handle(block_size=4096, queue_depth=1, o_direct="never",
                       _faults=[("delay", 1, 1, -1)])
pinned_before = outcore.aio.pinned_buffers()
if mutation == "pinned-set":
    t = h.new_pinned_tensor(N, torch.uint8)
    t.copy_(data if direction == "write" else torch.zeros(N, dtype=torch.uint8))
else:
    t = data.clone() if direction == "write" else torch.zeros(N, dtype=torch.uint8)
req = h.async_pwrite(t, path) if direction == "write" else h.async_pread(t, path)
if mutation == "resize":
    t.resize_(64 * N)  # reallocates the storage: its old memory is freed
elif mutation == "shrink":
    t.storage().resize_(16)
elif mutation == "set":
    t.set_(torch.zeros(1, dtype=torch.uint8))
elif mutation == "pinned-set":
    h.free_pinned_tensor(t)
    t.set_(torch.zeros(1, dtype=torch.uint8))  # the handle's last reference to the memory
else:
    del t
sentinels = [torch.full((N,), 0xAB, dtype=torch.uint8) for _ in range(8)]
error = None
try:
    req.wait()
except Exception as e:
    error = e
overwritten = [i for i, s in enumerate(sentinels) if not bool((s == 0xAB).all())]
if overwritten:
    sys.exit(f"sentinel tensors {overwritten} (allocated after the {mutation}) were overwritten")
if mutation == "shrink":
    if not isinstance(error, ValueError) or "resized" not in str(error):
        sys.exit(f"wait() after the storage shrank: expected ValueError, got {error!r}")
    # The failure is final: the request is released, and Handle.wait() returns at once.
    if req.wait() != 0 or h.wait() != 0 or h._core.pending() != 0:
        sys.exit("the failed request is still pending")
    req2 = h.async_pread(torch.zeros(N, dtype=torch.uint8), path)
    t2 = torch.zeros(N, dtype=torch.uint8)
    req3 = h.async_pread(t2, path)
    t2.storage().resize_(16)
    try:
        h.wait()  # each request once: it used to retry the failing one forever
        sys.exit("Handle.wait() after a storage shrank: no error")
    except ValueError:
        pass
    if h._core.pending() != 0:
        sys.exit("Handle.wait() left requests pending")
    sys.exit(0)
if error is not None:
    sys.exit(f"wait() raised {error!r}")
if direction == "write":
    with open(path, "rb") as f:
        if f.read() != data.numpy().tobytes():
            sys.exit("the file does not hold the tensor's bytes as they were when queued")
elif mutation == "resize" and not torch.equal(t[:N], data):
    sys.exit("the read did not land in the tensor's (reallocated) storage")
del req
if outcore.aio.pinned_buffers() != pinned_before:
    sys.exit(f"{outcore.aio.pinned_buffers() - pinned_before} pinned buffers still alive")
"""


class StorageLostBeforeWait(AioTest):
    def check_child(self, direction, mutation):
        here = os.path.dirname(os.path.abspath(__file__))
        r = subprocess.run([sys.executable, "-c", STORAGE_LOST_CHILD, here, direction, mutation,
                            self.path("lost.bin")], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, f"async {direction}, then {mutation} before wait(): "
                         f"exit status {r.returncode} (negative: killed by that signal)\n"
                         f"{r.stderr.strip()}")

    def test_async_read_into_a_resized_tensor_lands_in_its_storage(self):
        self.check_child("read", "resize")

    def test_async_read_into_a_tensor_set_to_other_memory(self):
        self.check_child("read", "set")

    def test_async_read_into_a_deleted_tensor(self):
        self.check_child("read", "del")

    def test_async_read_into_a_shrunk_storage_raises_at_wait(self):
        self.check_child("read", "shrink")

    def test_async_read_into_a_freed_pinned_tensor_set_to_other_memory(self):
        self.check_child("read", "pinned-set")

    def test_async_write_from_a_resized_tensor_writes_its_queued_bytes(self):
        self.check_child("write", "resize")

    def test_async_write_from_a_tensor_set_to_other_memory(self):
        self.check_child("write", "set")

    def test_async_write_from_a_deleted_tensor(self):
        self.check_child("write", "del")

    def test_async_write_from_a_freed_pinned_tensor_set_to_other_memory(self):
        self.check_child("write", "pinned-set")


class Errors(AioTest):
    def assert_io_error(self, cm, err, path, offset):
        e = cm.exception
        self.assertIsInstance(e, OSError)
        self.assertEqual(e.errno, err)
        self.assertEqual(e.filename, path)
        self.assertEqual(e.offset, offset)
        self.assertIn(path, str(e))
        self.assertIn(f"offset {offset}", str(e))

    def test_missing_file_and_directory(self):
        h = aio.Handle()
        missing = self.path("no/such/dir/f.bin")
        with self.assertRaises(outcore.IoError) as cm:
            h.pread(torch.empty(10), missing, offset=40)
        self.assert_io_error(cm, errno.ENOENT, missing, 40)
        with self.assertRaises(outcore.IoError) as cm:
            h.pwrite(torch.empty(10), missing, offset=8)
        self.assert_io_error(cm, errno.ENOENT, missing, 8)

    def test_two_offsets_are_refused(self):
        # file_offset (DeepNVMe's name) and offset= together: which one was meant? Once, offset=
        # won silently.
        h = aio.Handle()
        path = self.path("two.bin")
        with self.assertRaisesRegex(TypeError, "file_offset=8 and offset=16 both given"):
            h.pwrite(torch.zeros(4), path, file_offset=8, offset=16)
        self.assertFalse(os.path.exists(path))
        with self.assertRaisesRegex(TypeError, "both given"):
            h.sync_pread(torch.zeros(4), path, 8, offset=16)

    def test_read_past_end_of_file(self):
        h = aio.Handle()
        path = self.path("short.bin")
        h.pwrite(torch.ones(100), path)  # 400 bytes
        with self.assertRaises(outcore.IoError) as cm:
            h.pread(torch.empty(100), path, offset=200)
        self.assert_io_error(cm, errno.EIO, path, 400)  # where the file ends
        self.assertIn("end of file", str(cm.exception))

    def test_injected_eio_and_enospc(self):
        path = self.path("faults.bin")
        src = random_tensor(3 * 4096, torch.uint8, 5)
        # The second write request (block_size 4096: the piece at offset 4096) fails.
        h = aio.Handle(block_size=4096, _faults=[("eio", 2, 0, 1)])
        with self.assertRaises(outcore.IoError) as cm:
            h.pwrite(src, path)
        self.assert_io_error(cm, errno.EIO, path, 4096)
        h = aio.Handle(block_size=4096, _faults=[("enospc", 1, 0, 1)])
        with self.assertRaises(outcore.IoError) as cm:
            h.async_pwrite(src, path, offset=8192).wait()
        self.assert_io_error(cm, errno.ENOSPC, path, 8192)
        # Reads: an EIO on the first read request.
        h = aio.Handle(block_size=4096, _faults=[("eio", 1, 0, 0)])
        h.pwrite(src, path)
        with self.assertRaises(outcore.IoError) as cm:
            h.pread(torch.empty_like(src), path)
        self.assert_io_error(cm, errno.EIO, path, 0)

    def test_wait_raises_oldest_failure_after_all_complete(self):
        path = self.path("mixed.bin")
        h = aio.Handle(block_size=4096, _faults=[("eio", 2, 0, 1)])
        reqs = [h.async_pwrite(random_tensor(4096, torch.uint8, i), path, 4096 * i)
                for i in range(4)]
        with self.assertRaises(outcore.IoError) as cm:
            h.wait()
        self.assertEqual(cm.exception.offset, 4096)
        self.assertEqual(h.pending(), 0)
        self.assertEqual([r.wait() for r in reqs], [0, 0, 0, 0])

    def test_misaligned_request_with_o_direct_always(self):
        h = aio.Handle(o_direct="always")
        path = self.path("mis.bin")
        aligned = h.new_pinned_tensor(4096, torch.uint8)
        for tensor, offset in ((aligned[1:1025], 0), (aligned[:1024], 0), (aligned, 100)):
            with self.assertRaises(outcore.InvalidArgument) as cm:
                h.pwrite(tensor, path, offset=offset)
            self.assertIsInstance(cm.exception, ValueError)
            self.assertIn(path, str(cm.exception))
            self.assertIn(f"offset {offset}", str(cm.exception))
        self.assertEqual(h.pending(), 0)

    def test_bad_tensors_and_arguments(self):
        h = aio.Handle()
        path = self.path("bad.bin")
        with self.assertRaisesRegex(ValueError, f"{path}: offset 12: .*contiguous"):
            h.pwrite(torch.zeros(4, 4).t(), path, offset=12)
        # Views whose bytes are not their values (the sign or the imaginary part flipped lazily)
        for view in (torch.tensor([1 + 2j]).conj(), torch._neg_view(torch.tensor([1.0]))):
            with self.assertRaisesRegex(ValueError, f"{path}: offset 0: .*negative view"):
                h.sync_pwrite(view, path)
        with self.assertRaisesRegex(ValueError, f"{path}: offset -1"):
            h.pwrite(torch.zeros(4), path, offset=-1)
        with self.assertRaisesRegex(TypeError, f"{path}: offset 0"):
            h.pwrite(b"bytes", path)
        with self.assertRaisesRegex(TypeError, "validate must be a bool.*offset="):
            h.pwrite(torch.zeros(4), path, 4096)  # DeepNVMe's third argument is validate
        with self.assertRaisesRegex(ValueError, "o_direct"):
            aio.Handle(o_direct="sometimes")
        with self.assertRaisesRegex(ValueError, "block_size"):
            aio.Handle(block_size=1000)
        with self.assertRaisesRegex(ValueError, "not a tensor from this handle"):
            h.free_pinned_tensor(torch.zeros(4))
        read_only = self.path("ro.bin")
        h.pwrite(torch.zeros(4), read_only)
        os.chmod(read_only, stat.S_IRUSR)
        if os.geteuid() != 0:  # root may write anyway
            with self.assertRaises(outcore.IoError) as cm:
                h.pwrite(torch.zeros(4), read_only, offset=4)
            self.assert_io_error(cm, errno.EACCES, read_only, 4)



class ReadOnlyMemory(AioTest):
    def test_a_read_into_read_only_memory_is_refused_never_a_fault(self):
        # A tensor over a read-only mapping: the synchronous read gets the kernel's EFAULT, the
        # asynchronous one (stored at the wait by a copy) is refused when queued.
        src, ro = self.path("src.bin"), self.path("ro.bin")
        with open(src, "wb") as f:
            f.write(b"\2" * 8192)
        with open(ro, "wb") as f:
            f.write(b"\1" * 8192)
        with open(ro, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 8192, prot=mmap.PROT_READ)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch: "The given buffer is not writable"
                t = torch.frombuffer(mapping, dtype=torch.uint8)
            h = aio.Handle()
            with self.assertRaisesRegex(ValueError, f"{src}: offset 4096: .*read-only"):
                h.async_pread(t[:4096], src, offset=4096)
            with self.assertRaises(outcore.IoError) as cm:
                h.pread(t, src)
            self.assertEqual(cm.exception.errno, errno.EFAULT)
            self.assertEqual(cm.exception.filename, src)
            self.assertEqual(h.wait(), 0)
            self.assertEqual(bytes(mapping[:8]), b"\1" * 8)
            # Writable memory still reads asynchronously.
            w = torch.zeros(4096, dtype=torch.uint8)
            h.async_pread(w, src).wait()
            self.assertTrue(bool((w == 2).all()))
            del t
        finally:
            mapping.close()


class PathsWithNullBytes(AioTest):
    def test_an_embedded_null_byte_is_refused_not_cut_short(self):
        # The C library stops a path at its first null byte: "a\0.bak" would open "a".
        h = aio.Handle()
        target = self.path("a")
        h.pwrite(torch.full((3,), 65, dtype=torch.uint8), target)
        calls = [("sync_pwrite", True), ("pwrite", True), ("write", True),
                 ("async_pwrite", True), ("sync_pread", False), ("pread", False),
                 ("read", False), ("async_pread", False)]
        for name, writes in calls:
            for bad in (target + "\0.bak", os.fsencode(target) + b"\0.bak"):
                buffer = torch.full((3,), 88 if writes else 7, dtype=torch.uint8)
                with self.assertRaisesRegex(ValueError, "embedded null byte", msg=name) as cm:
                    getattr(h, name)(buffer, bad)
                self.assertIn("filename", str(cm.exception))
                self.assertNotIn("\0", str(cm.exception))
                self.assertEqual(as_bytes(buffer), bytes([88 if writes else 7]) * 3, name)
        for function in (aio.aio_read, aio.aio_write):
            with self.assertRaisesRegex(ValueError, "embedded null byte"):
                function(torch.zeros(3, dtype=torch.uint8), target + "\0")
        # The compiled layer refuses it too, whoever calls it.
        t = torch.zeros(3, dtype=torch.uint8)
        with self.assertRaisesRegex(ValueError, "embedded null byte"):
            h._core.submit(True, t, t.data_ptr(), 3, target + "\0.bak", 0)
        self.assertEqual(h.pending(), 0)
        self.assertEqual(file_bytes(target, 0, 10), b"AAA")
        self.assertEqual(os.listdir(self.dir), ["a"])


class Arguments(AioTest):
    def test_non_integer_offsets_are_refused(self):
        h = aio.Handle()
        path = self.path("off.bin")
        calls = [lambda bad: h.pwrite(torch.zeros(4), path, offset=bad),
                 lambda bad: h.sync_pread(torch.zeros(4), path, bad),
                 lambda bad: h.async_pwrite(torch.zeros(4), path, file_offset=bad)]
        for bad in (1.7, 2.0, "3", b"4", None):
            for call in calls[1:] if bad is None else calls:  # offset=None: not given
                with self.assertRaises(TypeError) as cm:
                    call(bad)
                self.assertIn("offset", str(cm.exception))
                self.assertIn(repr(bad), str(cm.exception))
                self.assertIn(path, str(cm.exception))
        self.assertFalse(os.path.exists(path))
        self.assertEqual(h.pwrite(torch.zeros(4), path, offset=torch.tensor(4)), 1)
        self.assertEqual(os.path.getsize(path), 20)

    def test_sizes_out_of_range_raise_value_error_naming_the_argument(self):
        for kwargs in ({"block_size": -1}, {"block_size": 2**64}, {"block_size": 0},
                       {"queue_depth": -1}, {"queue_depth": 2**32}, {"queue_depth": 5000},
                       {"intra_op_parallelism": -1}, {"intra_op_parallelism": 2**32},
                       {"intra_op_parallelism": 0}):
            (name, value), = kwargs.items()
            with self.assertRaises(ValueError, msg=str(kwargs)) as cm:
                aio.Handle(**kwargs)
            self.assertIn(name, str(cm.exception))
            self.assertIn(str(value), str(cm.exception))
            with self.assertRaises(ValueError, msg=str(kwargs)) as cm:
                aio.aio_handle(**kwargs)
            self.assertIn(f"{name}: got {value}", str(cm.exception))
        for kwargs in ({"block_size": 4096.0}, {"queue_depth": "8"},
                       {"intra_op_parallelism": 1.5}):
            (name, value), = kwargs.items()
            with self.assertRaisesRegex(TypeError, f"{name}: .*{value!r}", msg=str(kwargs)):
                aio.Handle(**kwargs)
        h = aio.Handle()
        path = self.path("range.bin")
        for numel, dtype in ((2**62, torch.float32), (2**64, torch.uint8), (-1, torch.uint8),
                             (2**61, torch.float64)):
            with self.assertRaises(ValueError, msg=f"{numel} x {dtype}") as cm:
                h.new_pinned_tensor(numel, dtype)
            self.assertIn(f"numel: got {numel}", str(cm.exception))
        with self.assertRaisesRegex(TypeError, "numel: .*2.5"):
            h.new_pinned_tensor(2.5)
        for offset in (2**64, 2**63):
            with self.assertRaisesRegex(ValueError, f"{path}: offset {offset}: "):
                h.pwrite(torch.zeros(4), path, offset=offset)
        self.assertFalse(os.path.exists(path))

    def test_new_pinned_tensor_of_zero_elements(self):
        h = aio.Handle()
        buffers = aio.pinned_buffers()
        for t in (h.new_pinned_tensor(0), h.new_pinned_tensor(0, torch.float16),
                  h.new_cpu_locked_tensor(0, torch.zeros(1, dtype=torch.int64))):
            self.assertEqual(t.numel(), 0)
            self.assertEqual(t.shape, (0,))
            self.assertTrue(h.free_pinned_tensor(t))
        self.assertEqual(h.new_pinned_tensor(0, torch.float16).dtype, torch.float16)
        self.assertEqual(h.new_pinned_tensor(0).dtype, torch.float32)
        self.assertEqual(aio.pinned_buffers(), buffers)
        self.assertEqual(h.pwrite(h.new_pinned_tensor(0), self.path("empty.bin")), 1)
        # None (or another object) where a tensor or dtype goes: a TypeError saying so, and no
        # memory pinned for it.
        for call in (lambda: h.new_pinned_tensor(4, None), lambda: h.free_pinned_tensor(None),
                     lambda: h.is_pinned(None), lambda: h.new_cpu_locked_tensor(4, None)):
            with self.assertRaisesRegex(TypeError, "expected a torch.Tensor|must be a torch.dtype"):
                call()
        self.assertEqual(aio.pinned_buffers(), buffers)


class FailuresLeaveNoTrace(AioTest):
    def test_failed_sync_read_past_end_leaves_the_tensor_untouched(self):
        path = self.path("short.bin")
        data = random_tensor(3 * 4096 + 100, torch.uint8, 4)
        aio.Handle().pwrite(data, path)
        for h in (aio.Handle(block_size=4096), aio.Handle(block_size=4096, queue_depth=1),
                  aio.Handle(block_size=4096, intra_op_parallelism=3, o_direct="never")):
            pinned = h.new_pinned_tensor(8 * 4096, torch.uint8)
            for dst in (torch.full((8 * 4096,), 7, dtype=torch.uint8), pinned):
                dst.fill_(7)
                for read in (lambda: h.sync_pread(dst, path), lambda: h.pread(dst, path),
                             lambda: h.read(dst, path, True),
                             lambda: h.pread(dst[:4096], path, offset=3 * 4096)):
                    with self.assertRaises(outcore.IoError) as cm:
                        read()
                    self.assertEqual(int((dst != 7).sum()), 0, "bytes stored by a failed read")
                    self.assertEqual(cm.exception.errno, errno.EIO)
                    self.assertEqual(cm.exception.offset, data.numel())
                    self.assertIn("end of file", str(cm.exception))
            self.assertEqual(h.pending(), 0)

    def test_a_failed_write_removes_the_file_it_created_only(self):
        h = aio.Handle()
        new = self.path("new.bin")
        old = self.path("old.bin")
        h.pwrite(torch.full((5,), 66, dtype=torch.uint8), old)
        for offset in (2**62, 2**63 - 1):
            for write in (lambda p: h.sync_pwrite(torch.full((3,), 88, dtype=torch.uint8), p,
                                                  offset),
                          lambda p: h.async_pwrite(torch.zeros(3, dtype=torch.uint8), p,
                                                   offset).wait()):
                try:
                    write(new)
                except outcore.IoError:
                    self.assertFalse(os.path.exists(new), f"created by a failed write at {offset}")
                else:  # this filesystem holds a file that large (sparse)
                    os.unlink(new)
                    continue
                with self.assertRaises(outcore.IoError):
                    write(old)
                self.assertEqual(file_bytes(old, 0, 100), b"BBBBB")
        # Injected failures: of the first piece, and of a later one after the first was written.
        src = random_tensor(3 * 4096, torch.uint8, 6)
        for fault in (("eio", 1, 0, 1), ("enospc", 2, 0, 1)):
            with self.assertRaises(outcore.IoError):
                aio.Handle(block_size=4096, _faults=[fault]).pwrite(src, new)
            self.assertFalse(os.path.exists(new), f"created by a write failing with {fault}")
            with self.assertRaises(outcore.IoError):
                aio.Handle(block_size=4096, _faults=[fault]).pwrite(src, old)
            self.assertTrue(os.path.exists(old))
        # A file another request of the handle also wrote is kept.
        h = aio.Handle(block_size=4096, _faults=[("eio", 1, 0, 1)])
        first = h.async_pwrite(src[:4096], new)
        second = h.async_pwrite(src[4096:], new, offset=4096)
        second.wait()
        with self.assertRaises(outcore.IoError):
            first.wait()
        self.assertEqual(file_bytes(new, 4096, 2 * 4096), as_bytes(src[4096:]))
        # A handle gone with a write it never waited (it succeeded): a later handle, maybe at the
        # same address, whose first write fails removes only its own file.
        done = self.path("done.bin")
        gone = aio.Handle()
        gone.async_pwrite(src[:4096], done)
        del gone
        fresh = self.path("fresh.bin")
        for _ in range(3):
            with self.assertRaises(outcore.IoError):
                aio.Handle(block_size=4096, _faults=[("eio", 1, 0, 1)]).pwrite(src, fresh)
            self.assertFalse(os.path.exists(fresh))
        self.assertEqual(file_bytes(done, 0, 4096), as_bytes(src[:4096]))
        # So is one another handle wrote: its write succeeded, its bytes stay.
        os.unlink(new)
        failing = aio.Handle(block_size=4096, _faults=[("eio", 1, 0, 1)])
        first = failing.async_pwrite(src[:4096], new)
        aio.Handle().sync_pwrite(src[4096:], new, 4096)
        with self.assertRaises(outcore.IoError):
            first.wait()
        self.assertEqual(file_bytes(new, 4096, 2 * 4096), as_bytes(src[4096:]))

    def test_a_failed_write_racing_another_threads_write_keeps_that_write(self):
        # Two handles on two threads write one new path at once; B's write fails (EFBIG). A's
        # successful write must be there afterwards: B's clean-up once removed the file A had
        # just opened (a few tries in a hundred) when A's open was recorded after it.
        a, b = aio.Handle(), aio.Handle()
        ones = torch.full((1024,), 7, dtype=torch.uint8)
        big = torch.full((4096,), 9, dtype=torch.uint8)
        lost = []
        for i in range(400):
            path = self.path(f"race{i}.bin")
            barrier = threading.Barrier(2)
            result = {}

            def write_a():
                barrier.wait()
                try:
                    a.sync_pwrite(ones, path)
                    result["a"] = True
                except outcore.IoError:
                    result["a"] = False

            def write_b():
                barrier.wait()
                try:
                    b.sync_pwrite(big, path, 2**62)
                except outcore.IoError:
                    pass

            threads = [threading.Thread(target=write_a), threading.Thread(target=write_b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if result["a"] and (not os.path.exists(path) or
                                file_bytes(path, 0, 1024) != as_bytes(ones)):
                lost.append(i)
            if os.path.exists(path):
                os.unlink(path)
        self.assertEqual(lost, [], "successful writes whose file a failed write removed")

class Leaks(AioTest):
    def test_no_fd_or_pinned_memory_leaks_over_1000_calls(self):
        h = aio.Handle(block_size=4096)
        path = self.path("leak.bin")
        missing = self.path("missing/leak.bin")
        src = random_tensor(5000, torch.uint8, 1)
        dst = torch.empty_like(src)
        h.pwrite(src, path)
        fds, pinned, buffers = open_fds(), aio.pinned_bytes(), aio.pinned_buffers()
        for i in range(1000):
            kind = i % 5
            if kind == 0:
                h.pread(dst, path)
            elif kind == 1:
                h.async_pwrite(src, path, offset=i).wait()
            elif kind == 2:
                with self.assertRaises(outcore.IoError):
                    h.pread(dst, missing)
            elif kind == 3:
                with self.assertRaises(outcore.IoError):
                    h.pread(dst, path, offset=1 << 20)  # past the end
            else:
                t = h.new_pinned_tensor(1000 + i, torch.float32)
                t.fill_(1.0)
                h.free_pinned_tensor(t)
                del t
        self.assertEqual(h.pending(), 0)
        self.assertEqual(open_fds(), fds)
        self.assertEqual(aio.pinned_buffers(), buffers)
        self.assertEqual(aio.pinned_bytes(), pinned)

    def test_pinned_tensors_dropped_free_their_memory_while_the_handle_lives(self):
        # Without free_pinned_tensor too: the tensor and its views hold the memory, the handle
        # does not (it held every one until the handle went: mlocked memory grew without bound).
        h = aio.Handle()
        pinned, buffers = aio.pinned_bytes(), aio.pinned_buffers()
        kept = h.new_pinned_tensor(1024, torch.float32)
        view = kept[512:]
        del kept
        for i in range(200):
            t = h.new_pinned_tensor(65536, torch.float32)
            t.fill_(float(i))
            self.assertTrue(h.is_pinned(t))
            del t
        self.assertEqual(aio.pinned_buffers(), buffers + 1)  # the view's
        self.assertEqual(aio.pinned_bytes(), pinned + 4096)
        self.assertTrue(h.is_pinned(view))
        del view
        self.assertEqual(aio.pinned_bytes(), pinned)
        self.assertEqual(aio.pinned_buffers(), buffers)

    def test_handles_release_their_threads_and_rings(self):
        fds = open_fds()
        for i in range(50):
            h = aio.Handle(intra_op_parallelism=2)
            h.async_pwrite(torch.zeros(100), self.path("h.bin"))  # never waited: __del__ does
            del h
        self.assertEqual(open_fds(), fds)


class ForkAndInterrupts(AioTest):
    def wait_child(self, pid, seconds, what):
        """The exit code of forked child `pid`; fails the test (killing it) past `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.assertTrue(os.WIFEXITED(status))
                return os.WEXITSTATUS(status)
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                self.fail(what)
            time.sleep(0.01)

    def test_a_forked_child_is_refused_the_handle_and_exits(self):
        # The child has the handle but not its I/O threads: using it raises at once, and the
        # child's exit (which destroys it) does not wait for them (it used to hang forever).
        h = aio.Handle(intra_op_parallelism=2)
        h.sync_pwrite(torch.ones(1000), self.path("f.bin"))
        pid = os.fork()
        if pid == 0:  # the child: never returns to the test runner
            code = 3
            try:
                h.sync_pwrite(torch.ones(10), self.path("child.bin"))
            except outcore.Error as e:
                code = 0 if "make a new Handle in this process" in str(e) else 4
            except BaseException:
                code = 5
            try:
                del h  # destroys the handle: must not wait for threads the child lacks
                gc.collect()
            finally:
                os._exit(code)
        self.assertEqual(self.wait_child(pid, 30, "the forked child did not exit"), 0)
        self.assertFalse(os.path.exists(self.path("child.bin")))
        out = torch.zeros(1000)
        h.sync_pread(out, self.path("f.bin"))  # the parent's handle still works
        self.assertTrue(torch.equal(out, torch.ones(1000)))

    def test_a_fork_while_another_thread_writes_leaves_the_child_free_to_write(self):
        # A thread of the parent opening a write holds the process's record of created files;
        # a fork at that moment must not leave it locked in the child, whose writes would hang.
        # The tensors are made before the thread starts: torch's own first use of an operator
        # is not safe to fork in either.
        stop = threading.Event()
        data, child_data = torch.ones(16), torch.ones(4)

        def writer():
            h = aio.Handle()
            i = 0
            while not stop.is_set():
                h.sync_pwrite(data, self.path("w%d.bin" % (i % 64)))
                i += 1
                if i % 64 == 0:
                    for j in range(64):
                        os.remove(self.path("w%d.bin" % j))

        t = threading.Thread(target=writer)
        t.start()
        try:
            for k in range(200):
                pid = os.fork()
                if pid == 0:  # the child: never returns to the test runner
                    code = 3
                    try:
                        aio.Handle().sync_pwrite(child_data, self.path("c%d.bin" % k))
                        code = 0
                    finally:
                        os._exit(code)
                what = "child %d of a fork during another thread's writes hung" % k
                self.assertEqual(self.wait_child(pid, 20, what), 0)
        finally:
            stop.set()
            t.join()

    def test_an_interrupt_while_a_read_is_stored_leaves_it_to_the_next_wait(self):
        # A KeyboardInterrupt raised while wait() stores a read (through a private buffer) used
        # to drop the bytes and mark the request done; the next wait now stores them.
        h = aio.Handle()
        data = random_tensor(5000, torch.float32, 7)
        h.sync_pwrite(data, self.path("r.bin"))
        out = torch.zeros(5000)
        req = h.async_pread(out, self.path("r.bin"))
        original = torch.Tensor.copy_
        calls = []

        def interrupted_once(self_, *args, **kwargs):
            if not calls:
                calls.append(1)
                raise KeyboardInterrupt
            return original(self_, *args, **kwargs)

        torch.Tensor.copy_ = interrupted_once
        try:
            with self.assertRaises(KeyboardInterrupt):
                req.wait()
            self.assertTrue(req.done())
            self.assertEqual(req.wait(), 1)
        finally:
            torch.Tensor.copy_ = original
        self.assertEqual(as_bytes(out), as_bytes(data))
        self.assertEqual(req.wait(), 0)


if __name__ == "__main__":
    unittest.main()
