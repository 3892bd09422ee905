/* Two system calls the desktop's programs make that runsc 20240729 refuses, made to work from inside the sandbox
 * (preloaded by /etc/ld.so.preload in the `desktop` template; docs/design/desktop.md, "Under gVisor").
 *
 * close_range(first, ~0U, flags): gVisor reads `last` as a signed int and answers EINVAL, so glib's g_spawn
 * ("Failed to close file descriptor for child process") fails: xfce4-session starts none of xfwm4, xfdesktop or
 * the panel, and gtk-launch no application. `last` is clamped to INT_MAX, the same range.
 *
 * ioctl(master, TIOCPKT, &on): gVisor's pty master has no packet mode (ENOTTY), so VTE ("Failed to open PTY") and
 * with it xfce4-terminal cannot start a shell. Packet mode is emulated for such a master: each read() gets the
 * one-byte header TIOCPKT_DATA before the data. The control events packet mode would also report (a flush, a
 * stop or start of output) are never reported; VTE needs only the data. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TRACKED 4096
static volatile unsigned char packet_mode[TRACKED]; /* 1: this fd is a pty master read in emulated packet mode */

int close_range(unsigned int first, unsigned int last, int flags) {
    return (int)syscall(SYS_close_range, first, last > INT_MAX ? (unsigned int)INT_MAX : last, flags);
}

static int is_pty_master(int fd) {
    unsigned int n;
    return syscall(SYS_ioctl, fd, TIOCGPTN, &n) == 0;
}

int ioctl(int fd, unsigned long request, ...) {
    va_list ap;
    va_start(ap, request);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    long ret = syscall(SYS_ioctl, fd, request, arg);
    if (ret < 0 && request == TIOCPKT && (errno == ENOTTY || errno == EINVAL) && fd >= 0 && fd < TRACKED
            && arg != NULL && is_pty_master(fd)) {
        packet_mode[fd] = *(int *)arg != 0;
        return 0;
    }
    return (int)ret;
}

ssize_t read(int fd, void *buf, size_t count) {
    if (fd >= 0 && fd < TRACKED && packet_mode[fd] && count > 1) {
        if (!is_pty_master(fd)) { /* closed behind our back (dup2, close_range) and reused: forget it */
            packet_mode[fd] = 0;
            return syscall(SYS_read, fd, buf, count);
        }
        ssize_t got = syscall(SYS_read, fd, (char *)buf + 1, count - 1);
        if (got <= 0)
            return got;
        ((char *)buf)[0] = 0; /* TIOCPKT_DATA */
        return got + 1;
    }
    return syscall(SYS_read, fd, buf, count);
}

int close(int fd) {
    if (fd >= 0 && fd < TRACKED)
        packet_mode[fd] = 0;
    return (int)syscall(SYS_close, fd);
}
