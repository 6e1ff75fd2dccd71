/* Jobs that share one name on one `halod serve --token-file` (issue 24 §1).
 * Every rank is a process of its own with HALO_RENDEZVOUS at the service,
 * HALO_RENDEZVOUS_EXTERNAL=1, HALO_TOKEN and the same HALO_JOB_ID, and runs
 * forward exchanges for a few seconds, checking each halo.
 *
 *   staggered  two 2-rank jobs A and B: A0 and B1 start first, A1 and B0
 *              0.7 s later (they used to pair as A0+B1 and B0+A1, and all
 *              four computed on the other job's data to the end)
 *   third      one 2-rank job A, and 0.7 s later a third process claiming
 *              A's rank 1
 *
 * The ranks that arrive after a world has met must be refused at once with
 * HALO_ERR_RENDEZVOUS naming the job and their rank; the ranks that met must
 * stop with the service's reason instead of carrying on (the ones that met
 * first cannot be told apart from one job until the second run shows up).
 * A rank exits 0 (ran to the end on its own data), 2 (ran to the end on
 * another job's data), 3 (refused, as a late rank should be), 4 (stopped
 * with the reason, as a rank that met should be) or 1 (anything else).
 *
 *   test_shared_jobs HALOD staggered|third */
#include "launch.h"

#define STEPS 30
#define STEP_US 100000
#define LATE_US 700000

struct proc {
    int job, rank, late, want;
};

static const struct proc staggered[] = {
    {0, 0, 0, 4}, {1, 1, 0, 4}, {0, 1, 1, 3}, {1, 0, 1, 3}};
static const struct proc third[] = {{0, 0, 0, 4}, {0, 1, 0, 4}, {2, 1, 1, 3}};

/* The reason the service gives (rendezvous/session.go) names the job, the
 * rank that arrived, and that the world had met. */
static int says_why(const char *msg) {
    return strstr(msg, "\"shared\"") != NULL && strstr(msg, "had met") != NULL;
}

static int run_rank(int job, int rank, int late) {
    g_rank = rank;
    if (late) usleep(LATE_US);
    halo_comm_t c;
    halo_result_t rc = halo_comm_create(rank, 2, NULL, &c);
    if (rc != HALO_SUCCESS) {
        const char *msg = halo_last_error();
        char own[32];
        snprintf(own, sizeof own, "rank %d", rank);
        printf("job %c rank %d: refused: %s: %s\n", 'A' + job, rank, halo_strerror(rc), msg);
        return rc == HALO_ERR_RENDEZVOUS && says_why(msg) && strstr(msg, own) != NULL ? 3 : 1;
    }
    int64_t shape[1] = {4};
    halo_plan_params_t p = plan_1d(shape, 1, 1);
    halo_plan_t plan = NULL;
    float x[4], out[6];
    for (int i = 0; i < 4; i++) x[i] = (float)(1000 * (job + 1) + 10 * rank + i);
    int crossed = 0, step = 0;
    rc = halo_plan_create(c, &p, &plan);
    for (; rc == HALO_SUCCESS && step < STEPS; step++) {
        rc = halo_plan_forward(plan, x, out);
        if (rc != HALO_SUCCESS) break;
        float got = rank == 0 ? out[5] : out[0];
        crossed += got < 1000 * (job + 1) || got >= 1000 * (job + 2);
        usleep(STEP_US);
    }
    int code = crossed ? 2 : 0;
    if (rc != HALO_SUCCESS) {
        const char *msg = halo_last_error();
        printf("job %c rank %d: stopped at step %d (%d on another job's data): %s: %s\n", 'A' + job, rank, step,
               crossed, halo_strerror(rc), msg);
        code = (rc == HALO_ERR_RENDEZVOUS || rc == HALO_ERR_COMM_FAILED) && says_why(msg) ? 4 : 1;
    } else {
        printf("job %c rank %d: ran %d steps, %d of them on another job's data\n", 'A' + job, rank, STEPS, crossed);
    }
    if (plan) halo_plan_destroy(plan);
    halo_comm_destroy(c);
    return code;
}

/* Starts `halod serve` on a free loopback port with a token file and waits
 * until it accepts connections; returns its pid. */
static pid_t start_service(const char *halod, int port, const char *token_file) {
    char listen[64];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    char *args[] = {(char *)halod, "serve", "--listen", listen, "--token-file", (char *)token_file, NULL};
    pid_t pid;
    if (posix_spawn(&pid, halod, NULL, NULL, args, environ) != 0) {
        perror("posix_spawn halod");
        exit(1);
    }
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (double end = now_s() + 20; now_s() < end; usleep(20000)) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        int ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
        close(fd);
        if (ok) return pid;
    }
    fprintf(stderr, "halod serve did not listen on %s within 20 s\n", listen);
    kill(pid, SIGKILL);
    exit(1);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i + 5 < argc; i++)
        if (!strcmp(argv[i], "--job"))
            return run_rank(atoi(argv[i + 1]), atoi(argv[i + 3]), atoi(argv[i + 5]));
    if (argc != 3 || (strcmp(argv[2], "staggered") && strcmp(argv[2], "third"))) {
        fprintf(stderr, "usage: %s HALOD staggered|third\n", argv[0]);
        return 2;
    }
    const struct proc *procs = strcmp(argv[2], "third") ? staggered : third;
    int n = strcmp(argv[2], "third") ? 4 : 3;

    static const char *vars[] = {"HALO_JOB_ATTEMPT", "TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE",
                                 "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID", "SLURM_STEP_ID"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) unsetenv(vars[i]);
    char token_file[] = "halo-token-XXXXXX"; /* in the working directory */
    int fd = mkstemp(token_file);
    if (fd < 0 || write(fd, "not-a-secret\n", 13) != 13) {
        perror("token file");
        return 1;
    }
    close(fd);
    int port = free_port();
    pid_t service = start_service(argv[1], port, token_file);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    setenv("HALO_RENDEZVOUS", addr, 1);
    setenv("HALO_RENDEZVOUS_EXTERNAL", "1", 1);
    setenv("HALO_TOKEN", "not-a-secret", 1);
    setenv("HALO_JOB_ID", "shared", 1);
    setenv("HALO_TIMEOUT_MS", "5000", 1);
    setenv("HALO_BOOTSTRAP_TIMEOUT_MS", "10000", 1);

    double t0 = now_s();
    pid_t pids[4];
    for (int i = 0; i < n; i++) {
        char js[4], rs[4], ls[4];
        snprintf(js, sizeof js, "%d", procs[i].job);
        snprintf(rs, sizeof rs, "%d", procs[i].rank);
        snprintf(ls, sizeof ls, "%d", procs[i].late);
        char *args[] = {argv[0], "--job", js, "--rank", rs, "--late", ls, NULL};
        if (posix_spawn(&pids[i], argv[0], NULL, NULL, args, environ) != 0) {
            perror("posix_spawn");
            return 1;
        }
    }
    int bad = 0;
    for (int i = 0; i < n; i++) {
        int status = 0, code;
        double end = now_s() + 60;
        while (waitpid(pids[i], &status, WNOHANG) == 0) {
            if (now_s() > end) {
                kill(pids[i], SIGKILL);
                waitpid(pids[i], &status, 0);
                break;
            }
            usleep(10000);
        }
        code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
        if (code != procs[i].want) {
            fprintf(stderr, "job %c rank %d (%s): ended with %d, want %d (%s)\n", 'A' + procs[i].job, procs[i].rank,
                    procs[i].late ? "late" : "first", code, procs[i].want,
                    procs[i].want == 3 ? "refused, naming the job and its rank" : "stopped with the service's reason");
            bad++;
        }
    }
    kill(service, SIGTERM);
    waitpid(service, NULL, 0);
    unlink(token_file);
    printf("test_shared_jobs %s: %s after %.1f s\n", argv[2], bad ? "FAILED" : "passed", now_s() - t0);
    return bad ? 1 : 0;
}
