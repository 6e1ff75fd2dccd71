/* Two jobs on one host with every HALO_* setting at its default (job "halo",
 * no attempt, rendezvous 127.0.0.1:29700 hosted by rank 0), two ranks each,
 * started 200 ms apart by two launchers, ranks of a job not at the same
 * moment: A0 at 0 ms, B1 at 200, A1 at 400, B0 at 500. This is the order in
 * which the jobs used to cross (A0 met B1, then B0 met A1, and all four
 * exchanged the other job's halos).
 *
 * Each job must either succeed with its own data on both ranks, or fail on
 * both ranks with HALO_ERR_RENDEZVOUS and a message that names the setting
 * to change. A rank exits 0 (own data), 3 (failed as it should) or 1
 * (crossed, or any other failure).
 *
 *   test_jobs              the launcher of both jobs */
#include "launch.h"

static const int delay_ms[2][2] = {{0, 400}, {300, 0}}; /* [job][rank], from the job's start */

static int run_rank(int job, int rank) {
    g_rank = rank;
    usleep(delay_ms[job][rank] * 1000);
    halo_comm_t c;
    halo_result_t rc = halo_comm_create(rank, 2, NULL, &c);
    if (rc != HALO_SUCCESS) {
        const char *msg = halo_last_error();
        printf("job %c rank %d: %s: %s\n", 'A' + job, rank, halo_strerror(rc), msg);
        return rc == HALO_ERR_RENDEZVOUS && strstr(msg, "HALO_") != NULL ? 3 : 1;
    }
    int64_t shape[1] = {4};
    halo_plan_params_t p = plan_1d(shape, 1, 1);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[4], out[6];
    for (int i = 0; i < 4; i++) x[i] = (float)(1000 * (job + 1) + 10 * rank + i);
    HALO_OK(halo_plan_forward(plan, x, out));
    /* rank 0's right halo is rank 1's first element; rank 1's left halo is
     * rank 0's last */
    float got = rank == 0 ? out[5] : out[0];
    float want = rank == 0 ? (float)(1000 * (job + 1) + 10) : (float)(1000 * (job + 1) + 3);
    HALO_OK(halo_comm_destroy(c));
    if (got != want) {
        printf("job %c rank %d: CROSSED: halo %g, want %g (from job %c)\n", 'A' + job, rank, got, want,
               got >= 2000 ? 'B' : 'A');
        return 1;
    }
    printf("job %c rank %d: own halo %g\n", 'A' + job, rank, got);
    return 0;
}

/* One job's launcher: starts both ranks, waits for them (killing them at
 * the deadline), and returns 0 if the job succeeded, 3 if it failed as it
 * should on both ranks, 1 otherwise. */
static int run_job(const char *self, int job) {
    pid_t pids[2];
    char js[4], rs[4];
    snprintf(js, sizeof js, "%d", job);
    for (int r = 0; r < 2; r++) {
        snprintf(rs, sizeof rs, "%d", r);
        char *args[] = {(char *)self, "--job", js, "--rank", rs, NULL};
        if (posix_spawn(&pids[r], self, NULL, NULL, args, environ) != 0) {
            perror("posix_spawn");
            return 1;
        }
    }
    int codes[2] = {-1, -1};
    double deadline = now_s() + 90;
    for (int left = 2; left > 0;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid == 0) {
            if (now_s() > deadline) {
                for (int r = 0; r < 2; r++)
                    if (codes[r] < 0) {
                        fprintf(stderr, "job %c: rank %d still running after 90 s: killing it\n", 'A' + job, r);
                        kill(pids[r], SIGKILL);
                        waitpid(pids[r], NULL, 0);
                    }
                return 1;
            }
            usleep(10000);
            continue;
        }
        if (pid < 0) break;
        for (int r = 0; r < 2; r++)
            if (pids[r] == pid) {
                codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
                left--;
            }
    }
    if (codes[0] == 0 && codes[1] == 0) return 0;
    if (codes[0] == 3 && codes[1] == 3) return 3;
    fprintf(stderr, "job %c: ranks ended with %d and %d\n", 'A' + job, codes[0], codes[1]);
    return 1;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i + 3 < argc; i++)
        if (!strcmp(argv[i], "--job") && !strcmp(argv[i + 2], "--rank"))
            return run_rank(atoi(argv[i + 1]), atoi(argv[i + 3]));

    /* Every setting at its default, whatever the caller's environment. */
    static const char *vars[] = {"HALO_RENDEZVOUS", "HALO_RENDEZVOUS_EXTERNAL", "HALO_TOKEN", "HALO_JOB_ID",
                                 "HALO_JOB_ATTEMPT", "HALO_BOOTSTRAP_TIMEOUT_MS", "TORCHELASTIC_RUN_ID",
                                 "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID", "SLURM_STEP_ID"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) unsetenv(vars[i]);

    /* Two launchers, as two torchrun or mpirun invocations would be. */
    pid_t launchers[2];
    double t0 = now_s();
    for (int job = 0; job < 2; job++) {
        if (job == 1) usleep(200000);
        launchers[job] = fork();
        if (launchers[job] < 0) {
            perror("fork");
            return 1;
        }
        if (launchers[job] == 0) _exit(run_job(argv[0], job));
    }
    int bad = 0;
    for (int job = 0; job < 2; job++) {
        int status;
        waitpid(launchers[job], &status, 0);
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
        printf("job %c: %s\n", 'A' + job, code == 0 ? "succeeded with its own data" : code == 3 ? "failed on both ranks, saying what to set" : "FAILED");
        bad += code != 0 && code != 3;
    }
    printf("test_jobs: %s after %.1f s\n", bad ? "FAILED" : "passed", now_s() - t0);
    return bad ? 1 : 0;
}
