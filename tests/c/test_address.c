/* Corrupted addresses through halo_comm_connect: every one is refused with
 * HALO_ERR_INVALID_ARGUMENT naming the rank, and none reaches UCX, which
 * aborts the process on many of them (UCX 1.13: "Assertion addr_version ==
 * V2", a negative interface overhead, a length past the end).
 *
 * One process, two communicators of a world of two, external bootstrap:
 * random blobs, every single-byte change of a real address, every
 * truncation, then the real addresses, which must still connect. */
#include "launch.h"

static uint64_t rng = 0x9e3779b97f4a7c15u;

static uint8_t next_byte(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint8_t)(rng >> 24);
}

static int tried = 0;

/* Connects comm (rank 0) with rank 1's address replaced by bad[0..n). */
static void expect_refused(halo_comm_t comm, const void *own, size_t own_len, const void *bad, size_t n, const char *what) {
    const void *addrs[2] = {own, bad};
    size_t lens[2] = {own_len, n};
    halo_result_t rc = halo_comm_connect(comm, addrs, lens);
    tried++;
    const char *msg = halo_last_error();
    CHECK(rc == HALO_ERR_INVALID_ARGUMENT, "%s: got %s (%s)", what, halo_strerror(rc), msg);
    if (rc == HALO_ERR_INVALID_ARGUMENT)
        CHECK(strstr(msg, "rank 1") != NULL, "%s: message does not name rank 1: %s", what, msg);
}

int main(void) {
    g_rank = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    halo_comm_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = HALO_COMM_PARAM_BOOTSTRAP;
    p.bootstrap = HALO_BOOTSTRAP_EXTERNAL;
    halo_comm_t c[2];
    const void *a[2];
    size_t n[2];
    for (int r = 0; r < 2; r++) {
        HALO_OK(halo_comm_create(r, 2, &p, &c[r]));
        HALO_OK(halo_comm_get_address(c[r], &a[r], &n[r]));
    }
    static uint8_t buf[1 << 16];
    char what[96];

    for (int i = 0; i < 200; i++) {
        size_t len = 1 + next_byte() + (size_t)next_byte() % 200;
        for (size_t k = 0; k < len; k++) buf[k] = next_byte();
        if (i % 4 == 0 && len >= 4) memcpy(buf, a[1], 4); /* a plausible start */
        snprintf(what, sizeof what, "random blob %d (%zu bytes)", i, len);
        expect_refused(c[0], a[0], n[0], buf, len, what);
    }
    static const uint8_t flips[] = {0xff, 0x01, 0x80};
    for (size_t i = 0; i < n[1]; i++) {
        for (size_t f = 0; f < sizeof flips; f++) {
            memcpy(buf, a[1], n[1]);
            buf[i] ^= flips[f];
            snprintf(what, sizeof what, "byte %zu ^ %#x", i, flips[f]);
            expect_refused(c[0], a[0], n[0], buf, n[1], what);
        }
    }
    for (size_t len = 1; len < n[1]; len++) {
        snprintf(what, sizeof what, "first %zu bytes", len);
        expect_refused(c[0], a[0], n[0], a[1], len, what);
    }
    memcpy(buf, a[1], n[1]);
    buf[n[1]] = 0;
    expect_refused(c[0], a[0], n[0], buf, n[1] + 1, "one byte more");
    expect_refused(c[0], a[0], n[0], a[0], n[0], "rank 0's address in rank 1's slot");

    /* Arguments the C ABI checks itself. */
    const void *nulls[2] = {a[0], NULL};
    size_t lens[2] = {n[0], n[1]};
    CHECK(halo_comm_connect(c[0], nulls, lens) == HALO_ERR_INVALID_ARGUMENT, "NULL address: %s", halo_last_error());
    CHECK(halo_comm_connect(c[0], NULL, lens) == HALO_ERR_INVALID_ARGUMENT, "NULL array: %s", halo_last_error());

    /* After all that, the real addresses connect both ranks. */
    for (int r = 0; r < 2; r++) HALO_OK(halo_comm_connect(c[r], a, n));
    for (int r = 0; r < 2; r++) HALO_OK(halo_comm_destroy(c[r]));
    printf("test_address: %d corrupted addresses refused, %d failures\n", tried, g_failures);
    return g_failures ? 1 : 0;
}
