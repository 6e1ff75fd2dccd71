// A C++ trainer using halo through the installed CMake package: a small RAII
// wrapper, then a causal temporal halo (left = kernel - 1) forward and
// backward on W ranks of this program, checked against the known answer.
//
//   halo_cpp_example W      launch W ranks on this machine
#include <halo.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

extern char **environ;

namespace {

void check(halo_result_t rc, const char *what) {
    if (rc != HALO_SUCCESS)
        throw std::runtime_error(std::string(what) + ": " + halo_strerror(rc) + ": " + halo_last_error());
}

class Comm {
  public:
    Comm(int rank, int world, const std::string &rendezvous) {
        halo_comm_params_t p{};
        p.field_mask = HALO_COMM_PARAM_RENDEZVOUS;
        p.rendezvous = rendezvous.c_str();
        check(halo_comm_create(rank, world, &p, &comm_), "halo_comm_create");
    }
    ~Comm() { halo_comm_destroy(comm_); }
    Comm(const Comm &) = delete;
    Comm &operator=(const Comm &) = delete;
    halo_comm_t get() const { return comm_; }

  private:
    halo_comm_t comm_ = nullptr;
};

// A plan for a contiguous float32 tensor [channels, time] sharded along time.
class Plan {
  public:
    Plan(const Comm &comm, std::vector<int64_t> shape, int dim, int64_t left, int64_t right) : shape_(std::move(shape)) {
        halo_plan_params_t p = HALO_PLAN_PARAMS_INITIALIZER;
        p.ndim = static_cast<int32_t>(shape_.size());
        p.shape = shape_.data();
        p.dim = dim;
        p.left = left;
        p.right = right;
        check(halo_plan_create(comm.get(), &p, &plan_), "halo_plan_create");
    }
    ~Plan() { halo_plan_destroy(plan_); }
    Plan(const Plan &) = delete;
    Plan &operator=(const Plan &) = delete;
    void forward(const float *x, float *out) { check(halo_plan_forward(plan_, x, out), "halo_plan_forward"); }
    // Through halo_exchange_start, the one call of every form (0.4): a
    // trainer would hold the request across work and wait for it later.
    void backward(const float *grad_out, float *grad_x) {
        void *tensors[2] = {const_cast<float *>(grad_out), grad_x};
        halo_request_t req;
        check(halo_exchange_start(plan_, HALO_DIR_BACKWARD, tensors, 2, nullptr, &req), "halo_exchange_start");
        check(halo_request_wait(req, nullptr), "halo_request_wait");
        check(halo_request_free(req), "halo_request_free");
    }

  private:
    std::vector<int64_t> shape_;
    halo_plan_t plan_ = nullptr;
};

int run_rank(int rank, int world, const std::string &rendezvous) {
    const int64_t C = 3, T = 5, K = 3;  // channels, local frames, kernel size
    Comm comm(rank, world, rendezvous);
    Plan plan(comm, {C, T}, 1, K - 1, 0);
    std::vector<float> x(C * T), out(C * (T + K - 1)), grad_x(C * T);
    for (int64_t c = 0; c < C; c++)
        for (int64_t t = 0; t < T; t++) x[c * T + t] = float(100 * c + rank * T + t);  // global frame index
    plan.forward(x.data(), out.data());
    int bad = 0;
    for (int64_t c = 0; c < C; c++)
        for (int64_t t = 0; t < T + K - 1; t++) {
            int64_t g = rank * T + t - (K - 1);  // global frame of out[t]
            float want = g < 0 ? 0.f : float(100 * c + g);
            bad += out[c * (T + K - 1) + t] != want;
        }
    std::vector<float> grad_out(out.size(), 1.f);
    plan.backward(grad_out.data(), grad_x.data());
    for (int64_t c = 0; c < C; c++)
        for (int64_t t = 0; t < T; t++) {
            // every frame gets 1 from itself, +1 if the next rank used it as halo
            float want = 1.f + (rank < world - 1 && t >= T - (K - 1) ? 1.f : 0.f);
            bad += grad_x[c * T + t] != want;
        }
    std::printf("rank %d: %s\n", rank, bad ? "WRONG" : "ok");
    return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char **argv) {
    try {
        if (argc == 4) return run_rank(std::atoi(argv[1]), std::atoi(argv[2]), argv[3]);
        int world = argc > 1 ? std::atoi(argv[1]) : 2;
        std::printf("halo %s (header %s), %d ranks\n", halo_version_string(), HALO_VERSION_STRING, world);
        std::string rendezvous = "127.0.0.1:" + std::to_string(29700 + getpid() % 1000);
        std::vector<pid_t> pids(world);
        for (int r = 0; r < world; r++) {
            std::string rs = std::to_string(r), ws = std::to_string(world);
            char *args[] = {argv[0], rs.data(), ws.data(), rendezvous.data(), nullptr};
            if (posix_spawn(&pids[r], argv[0], nullptr, nullptr, args, environ) != 0) return 2;
        }
        int failed = 0;
        for (pid_t p : pids) {
            int status = 0;
            waitpid(p, &status, 0);
            failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        }
        return failed ? 1 : 0;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
}
