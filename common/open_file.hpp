// Opening files for reading without blocking on what is not a file. open(2) of a FIFO for
// reading waits for a writer, and of some character devices forever, before the caller could
// check the file's type: every path outcore reads is opened here, with O_NONBLOCK, checked with
// fstat, and only then switched back to blocking I/O.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace outcore {

// Opens /dev/null on each of descriptors 0, 1 and 2 that is closed (a program started with
// `>&-`), so that the files and pipes the process opens next do not take those numbers and get
// its messages and results written into them. Every program's main calls it first.
void open_missing_standard_streams();

// What a st_mode is, in words: "a directory", "a FIFO (named pipe)", "a socket", ...
const char* file_kind(mode_t mode);

// Whether `a` and `b` name the same file: the same device and inode when both exist (through
// links, hard links and any spelling), else the same absolute path with its links resolved (a
// file about to be made). False when either is empty.
bool same_file(const std::string& a, const std::string& b);

// `path` with the links of its last component followed (readlink, relative ones from their
// directory; at most 40): the name a file written "through" it gets, which need not exist yet.
// `path` itself when it is not a link or a link cannot be read.
std::string resolve_links(const std::string& path);

// `path` absolute, normal, with the links of the part of it that exists resolved (as the kernel
// reads "link/.."), and without a trailing "/" or "/." ("dir/" and "dir/." name dir); "" when it
// cannot be resolved.
std::string resolved_path(const std::string& path);

// Where `path` lies inside directory `dir`, both resolved as above: the path relative to dir
// ("." for dir itself, "a/b" below it), or "" when it lies outside dir or either cannot be
// resolved. A file written through a link is where resolve_links(path) says.
std::string path_within(const std::string& path, const std::string& dir);

// What outcore writes "<name>.tmp-<pid>" (pid_max is at most 2^22: seven digits) appends.
inline constexpr std::string_view kTemporarySuffix = ".tmp-4194304";
// Refuses, before any work, an output `path` whose name is legal but whose longest derived name
// (the name with `suffix` appended, e.g. kTemporarySuffix) the filesystem would not take:
// InvalidArgument "`what` PATH: a name of N bytes ... at most M bytes". The limit is the nearest
// existing directory's NAME_MAX (255 where it cannot be asked).
void check_derived_name_fits(const std::string& path, std::string_view suffix,
                             std::string_view what);

// A file's identity: its device and inode.
struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileId&) const = default;
};
// The file `path` names (lstat: a link is the link itself), or `fd` is open on; false when
// there is none.
bool file_id_of(const std::string& path, FileId& id);
bool file_id_of(int fd, FileId& id);
// Removes `path` only while it still names file `id`: a file put at that name since (a user's,
// another run's) is kept. True when removed.
bool unlink_if_same(const std::string& path, const FileId& id);

// Removes the temporaries "<target>.tmp-<pid>[-<k>]" that writers of `target` killed before
// their rename (SIGKILL, a power cut) left beside it: regular files of one name (never a link),
// whose pid runs no more (or is this process's: call it before making a temporary of one's own),
// and that `ours` recognises from an open descriptor (their first bytes). Each one removed is
// warned about, naming it and `what` ("trace"); any other file is left. Nothing when the
// directory cannot be read.
void remove_killed_temporaries(const std::string& target, std::string_view what,
                               const std::function<bool(int fd)>& ours);
// Whether the file `fd` is open on is empty or begins with `head`: what a writer killed before
// or after its first bytes leaves.
bool empty_or_begins_with(int fd, std::string_view head);

// fsyncs directory `dir` ("" is the current one), so that a rename or unlink in it is durable.
// IoError naming the directory when it cannot be opened or synced.
void fsync_directory(const std::string& dir);
// fsyncs the directory holding `path` (its parent; the current one for a bare name).
void fsync_parent_directory(const std::string& path);

// The process's file mode creation mask, read without changing it (umask(2) would, for every
// thread); 022 where /proc does not say. For files made with a mode of their own and then
// fchmod'ed, so that they end as open(2) with 0644 would have made them.
mode_t creation_umask();

// Opens `path` read-only (plus `extra_flags`, e.g. O_DIRECT) without blocking, and returns the
// descriptor (O_CLOEXEC, blocking again) when it is a regular file, or also a block device when
// `allow_block_device`. Throws IoError (path, errno) when the open fails and InvalidArgument
// "<path>: is a FIFO (named pipe), not a regular file" for any other type; the descriptor is
// closed then. `what` names the file's role in messages ("model config", "token file").
int open_for_reading(const std::string& path, const char* what, int extra_flags = 0,
                     bool allow_block_device = false);

// The whole of a regular file of at most `limit` bytes, opened as above. CorruptData naming the
// path and both sizes when it is larger (or grows past the limit while read).
std::string read_whole_file(const std::string& path, const char* what, size_t limit);

}  // namespace outcore
