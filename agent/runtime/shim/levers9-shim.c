/*
 * levers9-shim: keeps a container's output and exit status while the agent comes and goes.
 *
 * Why: the agent may be killed, upgraded or restarted at any time, but the containers it
 * started must keep running, their stdout/stderr must keep landing in their log, and their
 * exit status must not be lost. So the agent never holds a container's pipes and is never its
 * parent: this small program is (like conmon for CRI-O). It is C so that it adds almost nothing
 * to a container's start and holds a few hundred KiB per container.
 *
 * levers9-shim run --id ID --bundle DIR --runc PATH --root DIR --runc-log FILE --pid-file FILE
 *                  --log FILE --log-max-bytes N --exit FILE --shim-pid-file FILE --sync-fd FD
 *   Detaches (fork, setsid, fork), becomes a child subreaper, runs `runc run -d` with pipes as
 *   the container's stdout/stderr, reports on the sync fd ("ok <container pid> <shim pid>\n",
 *   or "error <how runc ended>\n" followed by runc's log lines and stderr), then copies the
 *   pipes into the log in the CRI format, rotating it at N bytes (one old file kept), and when
 *   the container's init exits writes the exit file atomically and exits.
 *
 * levers9-shim exec --id ID --runc PATH --root DIR --runc-log FILE --pid-file FILE
 *                   --process FILE [--console-socket SOCK] --sync-fd FD
 *   Does not detach. Runs `runc exec -d` (so a console socket may be used), reports "ok <pid>"
 *   or an error on the sync fd, waits for the exec'd process (it re-parents to us, the
 *   subreaper) and exits with its status: the exit code, or 128 + the signal that killed it.
 *   Non-detached `runc exec` refuses --console-socket, and a process runc leaves behind is
 *   nobody's child we could wait for, hence this mode.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LINE_MAX_BYTES 16384 /* containerd's CRI limit: longer lines are split, tagged P */
#define OUT_BUFFER_BYTES (128 * 1024)
#define DRAIN_AFTER_EXIT_MS 2000 /* the pid namespace is gone; its pipes close right after */
#define REPORT_MAX_BYTES (64 * 1024)

struct options {
    const char *mode;
    const char *id;
    const char *bundle;
    const char *runc;
    const char *root;
    const char *runc_log;
    const char *pid_file;
    const char *log;
    const char *exit_path;
    const char *shim_pid_file;
    const char *process;
    const char *console_socket;
    long long log_max_bytes;
    int sync_fd;
};

static struct options opt = {.sync_fd = -1};

static void write_all(int fd, const char *data, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        data += n;
        len -= (size_t)n;
    }
}

static void sync_printf(const char *format, ...) {
    char line[1024];
    va_list args;
    if (opt.sync_fd < 0)
        return;
    va_start(args, format);
    int n = vsnprintf(line, sizeof line, format, args);
    va_end(args);
    if (n > 0)
        write_all(opt.sync_fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

/* Before the sync fd is known, errors go to stderr; afterwards to the sync fd, which is the
 * only channel the agent reads. */
static void fail(const char *format, ...) {
    char message[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    if (opt.sync_fd >= 0)
        sync_printf("error shim\nlevers9-shim: %s\n", message);
    else
        fprintf(stderr, "levers9-shim: %s\n", message);
    exit(2);
}

static void parse_options(int argc, char **argv) {
    if (argc < 2)
        fail("usage: levers9-shim run|exec --option value ...");
    opt.mode = argv[1];
    opt.log_max_bytes = -1;
    for (int i = 2; i < argc; i += 2) {
        const char *key = argv[i];
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (value == NULL)
            fail("option %s has no value", key);
        if (!strcmp(key, "--id"))
            opt.id = value;
        else if (!strcmp(key, "--bundle"))
            opt.bundle = value;
        else if (!strcmp(key, "--runc"))
            opt.runc = value;
        else if (!strcmp(key, "--root"))
            opt.root = value;
        else if (!strcmp(key, "--runc-log"))
            opt.runc_log = value;
        else if (!strcmp(key, "--pid-file"))
            opt.pid_file = value;
        else if (!strcmp(key, "--log"))
            opt.log = value;
        else if (!strcmp(key, "--log-max-bytes"))
            opt.log_max_bytes = strtoll(value, NULL, 10);
        else if (!strcmp(key, "--exit"))
            opt.exit_path = value;
        else if (!strcmp(key, "--shim-pid-file"))
            opt.shim_pid_file = value;
        else if (!strcmp(key, "--process"))
            opt.process = value;
        else if (!strcmp(key, "--console-socket"))
            opt.console_socket = value;
        else if (!strcmp(key, "--sync-fd")) {
            char *end;
            long fd = strtol(value, &end, 10);
            if (*end != '\0' || fd < 3 || fcntl((int)fd, F_GETFD) < 0)
                fail("--sync-fd %s is not an open descriptor", value);
            opt.sync_fd = (int)fd;
            fcntl(opt.sync_fd, F_SETFD, FD_CLOEXEC);
        } else
            fail("unknown option %s", key);
    }
    if (opt.sync_fd < 0)
        fail("--sync-fd is required");
    if (!opt.id || !opt.runc || !opt.root || !opt.runc_log || !opt.pid_file)
        fail("--id, --runc, --root, --runc-log and --pid-file are required");
    if (!strcmp(opt.mode, "run")) {
        if (!opt.bundle || !opt.log || !opt.exit_path || !opt.shim_pid_file ||
            opt.log_max_bytes < 0)
            fail("run needs --bundle, --log, --log-max-bytes, --exit and --shim-pid-file");
    } else if (!strcmp(opt.mode, "exec")) {
        if (!opt.process)
            fail("exec needs --process");
    } else
        fail("unknown mode %s: use run or exec", opt.mode);
}

/* Signals the shim blocks or ignores must not stay blocked or ignored in runc and the
 * container: both survive execve. */
static void reset_signals(void) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int sig = 1; sig < NSIG; sig++)
        if (sig != SIGKILL && sig != SIGSTOP)
            signal(sig, SIG_DFL);
}

static void open_devnull_on(int target) {
    int fd = open("/dev/null", O_RDWR);
    if (fd >= 0 && fd != target) {
        dup2(fd, target);
        close(fd);
    }
}

/* Readers never see a partial file (rename). `durable` also survives the node going down:
 * the exit status does; the shim's pid does not need to (no process survives a reboot), and an
 * fsync there would sit on every container's start. */
static void write_file_atomic(const char *path, const char *data, size_t len, int durable) {
    char partial[PATH_MAX];
    snprintf(partial, sizeof partial, "%s.tmp", path);
    int fd = open(partial, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    write_all(fd, data, len);
    if (durable)
        fsync(fd);
    close(fd);
    rename(partial, path);
}

static int read_pid_file(const char *path) {
    char text[32] = {0};
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return -1;
    long pid = strtol(text, NULL, 10);
    return pid > 0 && pid < INT_MAX ? (int)pid : -1;
}

/* Sends what runc said (its JSON log lines, then whatever it wrote to stderr) after an error
 * line; the agent picks runc's message out of it. Returns 1 if runc refused because a
 * container with this id exists: that container is not ours to delete. */
static int report_runc_failure(int status, int stderr_fd) {
    char text[REPORT_MAX_BYTES + 1];
    int exists = 0;
    if (WIFEXITED(status))
        sync_printf("error runc exited with status %d\n", WEXITSTATUS(status));
    else
        sync_printf("error runc was killed by signal %d\n", WTERMSIG(status));
    int fd = open(opt.runc_log, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        off_t size = lseek(fd, 0, SEEK_END);
        lseek(fd, size > (off_t)sizeof text ? size - (off_t)sizeof text : 0, SEEK_SET);
        ssize_t n = read(fd, text, REPORT_MAX_BYTES);
        if (n > 0) {
            write_all(opt.sync_fd, text, (size_t)n);
            text[n] = '\0';
            exists = strstr(text, "already exists") != NULL;
        }
        close(fd);
    }
    if (stderr_fd >= 0) {
        fcntl(stderr_fd, F_SETFL, O_NONBLOCK);
        ssize_t n = read(stderr_fd, text, REPORT_MAX_BYTES);
        if (n > 0) {
            write_all(opt.sync_fd, "\n", 1);
            write_all(opt.sync_fd, text, (size_t)n);
        }
    }
    return exists;
}

static pid_t spawn(char *const argv[], int in, int out, int err) {
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    reset_signals();
    if (in >= 0)
        dup2(in, 0);
    if (out >= 0)
        dup2(out, 1);
    if (err >= 0)
        dup2(err, 2);
    execvp(argv[0], argv);
    dprintf(2, "levers9-shim: cannot execute %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

static int wait_for(pid_t pid) {
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return -1;
    return status;
}

/* Used when the start failed half way: runc may have left a created container behind. */
static void force_delete(void) {
    char *argv[] = {(char *)opt.runc, "--root", (char *)opt.root, "delete", "--force",
                    (char *)opt.id, NULL};
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    pid_t pid = spawn(argv, devnull, devnull, devnull);
    if (pid > 0)
        wait_for(pid);
    if (devnull >= 0)
        close(devnull);
}

static int exit_code_of(int status) {
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return 255;
}

/* -- the container log ------------------------------------------------------------------- */

struct stream {
    int fd;
    const char *name;
    char line[LINE_MAX_BYTES];
    size_t len;
};

static int log_fd = -1;
static long long log_size;
static char out_buffer[OUT_BUFFER_BYTES];
static size_t out_len;

static void open_log(int truncate) {
    log_fd = open(opt.log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0),
                  0640);
    struct stat info;
    log_size = log_fd >= 0 && fstat(log_fd, &info) == 0 ? info.st_size : 0;
}

static void flush_log(void) {
    if (log_fd >= 0 && out_len > 0)
        write_all(log_fd, out_buffer, out_len);
    out_len = 0;
}

/* Keeps disk use near twice the limit: the current file and one previous one. */
static void rotate_log(void) {
    char previous[PATH_MAX];
    flush_log();
    snprintf(previous, sizeof previous, "%s.1", opt.log);
    if (log_fd >= 0)
        close(log_fd);
    rename(opt.log, previous);
    open_log(1);
}

static void timestamp(char *out, size_t size) {
    struct timespec now;
    struct tm utc;
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &utc);
    size_t n = strftime(out, size, "%Y-%m-%dT%H:%M:%S", &utc);
    snprintf(out + n, size - n, ".%09ldZ", now.tv_nsec);
}

static void emit(struct stream *s, char tag) {
    char header[80];
    timestamp(header, sizeof header);
    size_t header_len = strlen(header);
    int n = snprintf(header + header_len, sizeof header - header_len, " %s %c ", s->name, tag);
    header_len += (size_t)n;
    long long entry = (long long)(header_len + s->len + 1);
    if (opt.log_max_bytes > 0 && log_size > 0 && log_size + entry > opt.log_max_bytes)
        rotate_log();
    if (out_len + (size_t)entry > sizeof out_buffer)
        flush_log();
    memcpy(out_buffer + out_len, header, header_len);
    memcpy(out_buffer + out_len + header_len, s->line, s->len);
    out_buffer[out_len + header_len + s->len] = '\n';
    out_len += (size_t)entry;
    log_size += entry;
    s->len = 0;
}

static void feed(struct stream *s, const char *data, size_t n) {
    while (n > 0) {
        const char *newline = memchr(data, '\n', n);
        size_t segment = newline ? (size_t)(newline - data) : n;
        if (s->len + segment > LINE_MAX_BYTES) {
            size_t fill = LINE_MAX_BYTES - s->len;
            memcpy(s->line + s->len, data, fill);
            s->len = LINE_MAX_BYTES;
            emit(s, 'P');
            data += fill;
            n -= fill;
            continue;
        }
        memcpy(s->line + s->len, data, segment);
        s->len += segment;
        if (newline) {
            emit(s, 'F');
            data += segment + 1;
            n -= segment + 1;
        } else {
            data += segment;
            n -= segment;
        }
    }
}

/* Returns 0 once the stream reached EOF (or failed) and was closed. */
static int pump(struct stream *s) {
    static char chunk[65536];
    ssize_t n = read(s->fd, chunk, sizeof chunk);
    if (n > 0) {
        feed(s, chunk, (size_t)n);
        return 1;
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return 1;
    if (s->len > 0)
        emit(s, 'P');
    close(s->fd);
    s->fd = -1;
    return 0;
}

static long long now_ms(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

static void write_exit_file(int status, const char *finished_at) {
    char json[256];
    char signal_text[16] = "null";
    if (WIFSIGNALED(status))
        snprintf(signal_text, sizeof signal_text, "%d", WTERMSIG(status));
    int n = snprintf(json, sizeof json, "{\"exitCode\": %d, \"signal\": %s, \"finishedAt\": \"%s\"}\n",
                     exit_code_of(status), signal_text, finished_at);
    write_file_atomic(opt.exit_path, json, (size_t)n, 1);
}

static void detach(void) {
    pid_t pid = fork();
    if (pid < 0)
        fail("fork: %s", strerror(errno));
    if (pid > 0)
        _exit(0);
    setsid();
    pid = fork();
    if (pid < 0)
        fail("fork: %s", strerror(errno));
    if (pid > 0)
        _exit(0);
}

static int run_main(void) {
    detach();
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
        fail("cannot become a child subreaper: %s", strerror(errno));
    open_devnull_on(0);
    open_devnull_on(1);
    open_devnull_on(2);
    if (chdir("/") < 0)
        fail("chdir /: %s", strerror(errno));
    signal(SIGPIPE, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGINT, SIG_IGN);

    sigset_t child;
    sigemptyset(&child);
    sigaddset(&child, SIGCHLD);
    sigprocmask(SIG_BLOCK, &child, NULL);
    int signal_fd = signalfd(-1, &child, SFD_CLOEXEC | SFD_NONBLOCK);
    if (signal_fd < 0)
        fail("signalfd: %s", strerror(errno));

    open_log(0);
    if (log_fd < 0)
        fail("cannot open the log %s: %s", opt.log, strerror(errno));

    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0)
        fail("pipe: %s", strerror(errno));
    /* runc keeps a container's state in <root>/<id>. If that is there, the id is taken: say so
     * without touching anything (a failed start below deletes what runc left). */
    char state_dir[PATH_MAX];
    struct stat existing;
    snprintf(state_dir, sizeof state_dir, "%s/%s", opt.root, opt.id);
    if (stat(state_dir, &existing) == 0) {
        sync_printf("error exists\n{\"level\":\"error\",\"msg\":\"container with given ID "
                    "already exists\"}\n");
        return 1;
    }
    unlink(opt.pid_file);
    unlink(opt.runc_log);
    /* Written before the container exists, so an agent that dies during the start still finds
     * who to wait for. */
    char pid_text[32];
    int len = snprintf(pid_text, sizeof pid_text, "%d\n", (int)getpid());
    write_file_atomic(opt.shim_pid_file, pid_text, (size_t)len, 0);
    char *argv[] = {(char *)opt.runc, "--root", (char *)opt.root, "--log", (char *)opt.runc_log,
                    "--log-format", "json", "run", "--detach", "--pid-file", (char *)opt.pid_file,
                    "--bundle", (char *)opt.bundle, (char *)opt.id, NULL};
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    pid_t runc = spawn(argv, devnull, out[1], err[1]);
    if (runc < 0)
        fail("fork: %s", strerror(errno));
    close(devnull);
    close(out[1]);
    close(err[1]);

    int status = wait_for(runc);
    int container = -1;
    if (status == 0)
        container = read_pid_file(opt.pid_file);
    if (status != 0 || container <= 0) {
        int exists = report_runc_failure(status, err[0]);
        if (status == 0)
            sync_printf("\nlevers9-shim: runc wrote no pid to %s\n", opt.pid_file);
        if (!exists)
            force_delete();
        unlink(opt.shim_pid_file);
        return 1;
    }
    sync_printf("ok %d %d\n", container, (int)getpid());
    close(opt.sync_fd);
    opt.sync_fd = -1;

    struct stream streams[2] = {{.fd = out[0], .name = "stdout"}, {.fd = err[0], .name = "stderr"}};
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    int exited = 0, exit_status = 0;
    char finished_at[64] = "";
    long long drain_until = 0;
    for (;;) {
        if (!exited) {
            /* Reaps everything: orphans of the container re-parent to us, the subreaper. The
             * init may even be a zombie already, handed over when runc exited. */
            int st;
            pid_t pid;
            while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
                if (pid == container) {
                    exited = 1;
                    exit_status = st;
                    timestamp(finished_at, sizeof finished_at);
                    drain_until = now_ms() + DRAIN_AFTER_EXIT_MS;
                }
            }
        }
        if (exited && streams[0].fd < 0 && streams[1].fd < 0)
            break;
        struct pollfd fds[3];
        int count = 0;
        fds[count++] = (struct pollfd){.fd = exited ? -1 : signal_fd, .events = POLLIN};
        for (int i = 0; i < 2; i++)
            fds[count++] = (struct pollfd){.fd = streams[i].fd, .events = POLLIN};
        int timeout = -1;
        if (exited) {
            long long left = drain_until - now_ms();
            if (left <= 0)
                break;
            timeout = (int)left;
        }
        int ready = poll(fds, (nfds_t)count, timeout);
        if (ready < 0 && errno != EINTR)
            break;
        if (fds[0].revents) {
            struct signalfd_siginfo info;
            while (read(signal_fd, &info, sizeof info) > 0) {
            }
        }
        for (int i = 0; i < 2; i++)
            if (streams[i].fd >= 0 && fds[i + 1].revents)
                pump(&streams[i]);
        flush_log();
    }
    for (int i = 0; i < 2; i++)
        if (streams[i].fd >= 0 && streams[i].len > 0)
            emit(&streams[i], 'P');
    flush_log();
    if (log_fd >= 0)
        close(log_fd);
    write_exit_file(exit_status, finished_at);
    return 0;
}

/* -- exec -------------------------------------------------------------------------------- */

static volatile sig_atomic_t exec_target;

static void forward_signal(int sig) {
    if (exec_target > 0)
        kill((pid_t)exec_target, sig);
}

static int exec_main(void) {
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
        fail("cannot become a child subreaper: %s", strerror(errno));
    unlink(opt.pid_file);
    unlink(opt.runc_log);
    char *argv[20];
    int n = 0;
    argv[n++] = (char *)opt.runc;
    argv[n++] = "--root";
    argv[n++] = (char *)opt.root;
    argv[n++] = "--log";
    argv[n++] = (char *)opt.runc_log;
    argv[n++] = "--log-format";
    argv[n++] = "json";
    argv[n++] = "exec";
    argv[n++] = "--detach";
    argv[n++] = "--pid-file";
    argv[n++] = (char *)opt.pid_file;
    argv[n++] = "--process";
    argv[n++] = (char *)opt.process;
    if (opt.console_socket) {
        argv[n++] = "--tty";
        argv[n++] = "--console-socket";
        argv[n++] = (char *)opt.console_socket;
    }
    argv[n++] = (char *)opt.id;
    argv[n] = NULL;
    /* runc --detach hands its own stdin, stdout and stderr to the process, so runc keeps ours;
     * its messages are read from its log. This pipe only carries a failure to execute runc. */
    int err[2];
    if (pipe2(err, O_CLOEXEC) < 0)
        fail("pipe: %s", strerror(errno));
    pid_t runc = fork();
    if (runc < 0)
        fail("fork: %s", strerror(errno));
    if (runc == 0) {
        close(err[0]);
        reset_signals();
        execvp(argv[0], argv);
        dprintf(err[1], "levers9-shim: cannot execute %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(err[1]);
    int status = wait_for(runc);
    int target = status == 0 ? read_pid_file(opt.pid_file) : -1;
    if (status != 0 || target <= 0) {
        report_runc_failure(status, err[0]);
        return 1;
    }
    close(err[0]);
    exec_target = target;
    struct sigaction forward = {.sa_handler = forward_signal};
    sigemptyset(&forward.sa_mask);
    int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
    for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++)
        sigaction(forwarded[i], &forward, NULL);
    sync_printf("ok %d\n", target);
    close(opt.sync_fd);
    opt.sync_fd = -1;
    /* The caller sees EOF on the process's pipes when the process closes them, not when we do. */
    open_devnull_on(0);
    open_devnull_on(1);
    open_devnull_on(2);
    for (;;) {
        int st;
        pid_t pid = waitpid(-1, &st, 0);
        if (pid == target)
            return exit_code_of(st);
        if (pid < 0 && errno != EINTR)
            return 255;
    }
}

int main(int argc, char **argv) {
    parse_options(argc, argv);
    if (!strcmp(opt.mode, "run"))
        return run_main();
    return exec_main();
}
