#include "launch.h"
#include "memfit/errors.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace memfit::cli {
namespace {

volatile sig_atomic_t g_forward_signal = 0;
int g_wake_fd = -1;  // write end of a self-pipe: a signal wakes the poll loop at once

void wake() {
  const char c = 0;
  if (g_wake_fd >= 0) (void)!::write(g_wake_fd, &c, 1);
}
void on_signal(int sig) {
  g_forward_signal = sig;
  wake();
}
// Reaping at once when a rank dies names the rank that failed first, not one that failed
// because of it a moment later.
void on_child(int) { wake(); }

void write_all(int fd, const std::string& text) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the reader is gone: drop the output, keep supervising
    p += n;
    left -= static_cast<size_t>(n);
  }
}

// A port that was free a moment ago on 127.0.0.1 (the kernel picks it); the small race with
// other programs is the same as torchrun's.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("memfit launch: socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("memfit launch: cannot find a free port on 127.0.0.1: " + why);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

bool has_flag(const std::vector<std::string>& args, const std::string& flag) {
  return std::any_of(args.begin(), args.end(), [&](const std::string& a) { return a == flag || a.rfind(flag + "=", 0) == 0; });
}

struct Stream {
  int fd;            // read end of the rank's pipe
  int out;           // where its lines go: 1 or 2
  std::string partial;
};

struct Rank {
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream streams[2];
};

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) return "was killed by signal " + std::to_string(WTERMSIG(status));
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

int exit_code(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

void validate(const LaunchOptions& o) {
  check_option(o.nproc >= 1, "--nproc", o.nproc, "expected a positive integer");
  check_option(o.master_port >= 0 && o.master_port <= 65535, "--master-port", o.master_port, "expected 1 to 65535 (0: a free one)");
  if (o.command.empty() || o.command[0] != "train") {
    throw std::invalid_argument("memfit launch runs 'train': expected 'memfit launch --nproc N -- train [flags]'");
  }
  for (const char* flag : {"--world-size", "--rank", "--master"}) {
    if (has_flag(o.command, flag)) throw std::invalid_argument(std::string("memfit launch sets ") + flag + " itself: remove it from the train flags");
  }
}

// The train flags every rank gets; threads_note says what --threads was added, if any.
std::vector<std::string> common_flags(const LaunchOptions& o, int port, std::string& threads_note) {
  std::vector<std::string> common = o.command;
  if (!has_flag(common, "--threads")) {
    // N ranks on one machine share its cores (torchrun sets OMP_NUM_THREADS=1 likewise).
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    const int threads = std::max(1, static_cast<int>(cores) / o.nproc);
    common.insert(common.end(), {"--threads", std::to_string(threads)});
    threads_note = ", " + std::to_string(threads) + " thread(s) each";
  }
  common.insert(common.end(), {"--world-size", std::to_string(o.nproc), "--master", "127.0.0.1:" + std::to_string(port)});
  return common;
}

// This process's environment with NAME=value set (made before fork: the child only execs).
std::vector<std::string> environment_with(const std::string& name, const std::string& value) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind(name + "=", 0) != 0) env.emplace_back(*e);
  }
  env.push_back(name + "=" + value);
  return env;
}

std::vector<std::string> rank_args(const std::vector<std::string>& common, int r) {
  std::vector<std::string> args{"memfit"};
  args.insert(args.end(), common.begin(), common.end());
  args.insert(args.end(), {"--rank", std::to_string(r)});
  return args;
}

// What the launcher tracks while its ranks run.
struct Launcher {
  double grace_seconds = 0;
  int wake_pipe[2] = {-1, -1};
  struct sigaction old_int {}, old_term {}, old_pipe {}, old_chld {};
  std::vector<Rank> ranks;
  int result = 0;
  bool stopping = false;
  int forwarded = 0;
  std::chrono::steady_clock::time_point kill_deadline = std::chrono::steady_clock::time_point::max();
};

void install_signal_handlers(Launcher& l) {
  if (::pipe2(l.wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw std::runtime_error(std::string("memfit launch: pipe: ") + std::strerror(errno));
  }
  g_wake_fd = l.wake_pipe[1];
  g_forward_signal = 0;
  struct sigaction forward {}, child {}, ignore {};
  forward.sa_handler = on_signal;
  sigemptyset(&forward.sa_mask);
  sigaction(SIGINT, &forward, &l.old_int);
  sigaction(SIGTERM, &forward, &l.old_term);
  child.sa_handler = on_child;
  child.sa_flags = SA_NOCLDSTOP;
  sigemptyset(&child.sa_mask);
  sigaction(SIGCHLD, &child, &l.old_chld);
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore, &l.old_pipe);
}

void restore_signal_handlers(Launcher& l) {
  sigaction(SIGINT, &l.old_int, nullptr);
  sigaction(SIGTERM, &l.old_term, nullptr);
  sigaction(SIGPIPE, &l.old_pipe, nullptr);
  sigaction(SIGCHLD, &l.old_chld, nullptr);
  g_wake_fd = -1;
  ::close(l.wake_pipe[0]);
  ::close(l.wake_pipe[1]);
}

// The child after fork: dies with the launcher, has its own process group (a terminal's Ctrl-C
// reaches the launcher only, which forwards it once), default signal handling.
[[noreturn]] void exec_rank(pid_t launcher, int out_fd, int err_fd, std::vector<char*>& argv, std::vector<char*>& envp) {
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != launcher) ::_exit(1);
  ::setpgid(0, 0);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGPIPE, SIG_DFL);
  signal(SIGCHLD, SIG_DFL);
  ::dup2(out_fd, 1);
  ::dup2(err_fd, 2);
  ::execve("/proc/self/exe", argv.data(), envp.data());
  const std::string msg = std::string("memfit launch: cannot execute /proc/self/exe: ") + std::strerror(errno) + "\n";
  write_all(2, msg);
  ::_exit(127);
}

void start_ranks(Launcher& l, int nproc, const std::vector<std::string>& common) {
  const pid_t launcher = ::getpid();
  l.ranks.resize(static_cast<size_t>(nproc));
  for (int r = 0; r < nproc; ++r) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      throw std::runtime_error(std::string("memfit launch: pipe: ") + std::strerror(errno));
    }
    std::vector<std::string> args = rank_args(common, r);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // LOCAL_RANK, as torchrun sets it: a rank training on CUDA takes that GPU (trainer.h).
    std::vector<std::string> env = environment_with("LOCAL_RANK", std::to_string(r));
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);

    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("memfit launch: fork: ") + std::strerror(errno));
    if (pid == 0) exec_rank(launcher, out[1], err[1], argv, envp);
    ::close(out[1]);
    ::close(err[1]);
    auto& rank = l.ranks[static_cast<size_t>(r)];
    rank.pid = pid;
    rank.running = true;
    rank.streams[0] = {out[0], 1, {}};
    rank.streams[1] = {err[0], 2, {}};
  }
}

bool any_running(const std::vector<Rank>& ranks) {
  return std::any_of(ranks.begin(), ranks.end(), [](const Rank& x) { return x.running; });
}

// Sends sig to every running rank; the first call starts the grace period before SIGKILL.
void stop_all(Launcher& l, int sig) {
  for (auto& rank : l.ranks) {
    if (rank.running) ::kill(rank.pid, sig);
  }
  if (!l.stopping) l.kill_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(l.grace_seconds * 1000));
  l.stopping = true;
}

// Writes every complete line of rank r's stream, prefixed with its rank; keeps the rest.
void emit(size_t r, Stream& s, const char* data, size_t n) {
  s.partial.append(data, n);
  size_t start = 0, nl;
  std::string lines;
  while ((nl = s.partial.find('\n', start)) != std::string::npos) {
    lines += "[rank " + std::to_string(r) + "] " + s.partial.substr(start, nl - start + 1);
    start = nl + 1;
  }
  s.partial.erase(0, start);
  if (!lines.empty()) write_all(s.out, lines);
}

void drain(int fd) {
  char buf[64];
  while (::read(fd, buf, sizeof buf) > 0) {
  }
}

// Forwards what one read gets from rank r's stream; at its end, closes it (ending a last
// unfinished line).
void read_stream(size_t r, Stream& s) {
  char buf[8192];
  const ssize_t got = ::read(s.fd, buf, sizeof buf);
  if (got > 0) {
    emit(r, s, buf, static_cast<size_t>(got));
  } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
    if (!s.partial.empty()) emit(r, s, "\n", 1);
    ::close(s.fd);
    s.fd = -1;
  }
}

// One poll round: forwards every line a rank wrote, prefixed with its rank. False once every
// stream is closed and no rank runs: nothing is left to supervise.
bool forward_output(Launcher& l) {
  std::vector<pollfd> fds{{l.wake_pipe[0], POLLIN, 0}};
  std::vector<std::pair<size_t, int>> which{{0, -1}};
  for (size_t r = 0; r < l.ranks.size(); ++r) {
    for (int k = 0; k < 2; ++k) {
      if (l.ranks[r].streams[k].fd >= 0) {
        fds.push_back({l.ranks[r].streams[k].fd, POLLIN, 0});
        which.emplace_back(r, k);
      }
    }
  }
  if (fds.size() == 1 && !any_running(l.ranks)) return false;
  const int n = ::poll(fds.data(), fds.size(), 200);
  if (n <= 0) return true;
  for (size_t i = 0; i < fds.size(); ++i) {
    if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
    if (which[i].second < 0) {
      drain(l.wake_pipe[0]);
    } else {
      read_stream(which[i].first, l.ranks[which[i].first].streams[which[i].second]);
    }
  }
  return true;
}

void forward_pending_signal(Launcher& l) {
  if (g_forward_signal == 0) return;
  l.forwarded = g_forward_signal;
  g_forward_signal = 0;
  write_all(2, "memfit launch: got signal " + std::to_string(l.forwarded) + ", forwarding it to every rank\n");
  stop_all(l, l.forwarded);
}

// Reaps the ranks that have exited; the first failure (not one a forwarded signal caused)
// sets the result and stops the others.
void reap_ranks(Launcher& l) {
  for (size_t r = 0; r < l.ranks.size(); ++r) {
    auto& rank = l.ranks[r];
    if (!rank.running) continue;
    int status = 0;
    const pid_t done = ::waitpid(rank.pid, &status, WNOHANG);
    if (done != rank.pid) continue;
    rank.running = false;
    rank.status = status;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (failed && l.result == 0 && l.forwarded == 0) {
      l.result = exit_code(status);
      if (l.result == 0) l.result = 1;
      const bool others = any_running(l.ranks);
      write_all(2, "memfit launch: rank " + std::to_string(r) + " " + describe_status(status) +
                       (others ? "; stopping the other ranks\n" : "\n"));
      if (!l.stopping) stop_all(l, SIGTERM);
    }
  }
}

void kill_after_grace(Launcher& l) {
  if (l.stopping && std::chrono::steady_clock::now() > l.kill_deadline) {
    stop_all(l, SIGKILL);
    l.kill_deadline = std::chrono::steady_clock::time_point::max();
  }
}

}  // namespace

int launch(const LaunchOptions& o) {
  validate(o);
  const int port = o.master_port > 0 ? o.master_port : free_port();
  std::string threads_note;
  const std::vector<std::string> common = common_flags(o, port, threads_note);
  write_all(1, "memfit launch: " + std::to_string(o.nproc) + " ranks, master 127.0.0.1:" + std::to_string(port) + threads_note + "\n");

  Launcher l;
  l.grace_seconds = o.grace_seconds;
  install_signal_handlers(l);
  start_ranks(l, o.nproc, common);
  while (forward_output(l)) {
    forward_pending_signal(l);
    reap_ranks(l);
    kill_after_grace(l);
  }
  restore_signal_handlers(l);
  if (l.forwarded != 0) return 128 + l.forwarded;
  return l.result;
}

}  // namespace memfit::cli
