/*
 * Unlink ends the peer's access to our memory (docs/model.md, "Links"):
 * while a prompt process pushes into this decoder's cache in a loop, the
 * decoder unlinks (not forced). Once its unlink returns LLM_SUCCESS:
 * - no push of the prompt's that began after that moment returned
 *   LLM_SUCCESS (one in flight then may: its bytes landed before the
 *   unlink returned), and its next push fails;
 * - not a byte lands in the decoder's cache any more: a pattern written
 *   there right after the unlink is still whole 300 ms later.
 * 20 rounds, each with a fresh link, over the transport named:
 *
 *   unlink_test <transport>
 */
#include <stdlib.h>
#include <string.h>

#include "harness/mp.h"

#define ROUNDS 20
#define MIB 8 /* per tensor; 2 tensors, 4 slots: 4 MiB a push */

static const char *transport;

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

static void
test_unlink_ends_the_peers_access(void **state)
{
    const char *args[] = {"--role", "prompt", "--transport", transport, NULL};
    llmdd_option o = {"llm.Transport", transport};
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, (int64_t)MIB << 18}};
    char cmd[128], reply[128];
    llmdd_cache kv;

    (void)state;
    th_proc *p = mp_peer_start(1, args);
    snprintf(cmd, sizeof(cmd), "alloc-big %d 2 7", MIB);
    assert_int_equal(th_proc_cmd(p, cmd, reply, sizeof(reply)), 0);
    long long src = atoll(reply + 3);
    llmdd *dd = mp_decoder(MP_SELF, &o, 1);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &kv), LLM_SUCCESS);
    uint64_t size = th_tensor_size(&d);

    for (int r = 0; r < ROUNDS; r++) {
        assert_int_equal(th_link_retry(dd, 1, MP_IP, p->port, 3000),
                         LLM_SUCCESS);
        snprintf(cmd, sizeof(cmd), "push-loop %d %lld %lld 100000", MP_SELF,
                 src, (long long)kv.cache_id);
        assert_int_equal(th_proc_send(p, cmd), 0);
        /* Once the first push landed, unlink mid-loop. */
        assert_int_equal(th_proc_reply(p, reply, sizeof(reply)), -1);
        assert_string_equal(reply, "GO");
        th_sleep_ms(r % 7); /* somewhere in a push, or between two */
        assert_int_equal(th_unlink(dd, 1, MP_IP, p->port, false, 3000),
                         LLM_SUCCESS);
        int64_t unlinked = th_now_ms();
        for (uint32_t t = 0; t < 2; t++)
            memset((void *)(uintptr_t)kv.tensor_addrs[t], 0xA5, size);

        assert_int_equal(th_proc_reply(p, reply, sizeof(reply)), 0);
        unsigned done;
        long long last;
        char status[40];
        assert_int_equal(
            sscanf(reply, "OK %u %lld %39s", &done, &last, status), 3);
        assert_true(done > 0);
        if (last > unlinked)
            fail_msg("round %d: a push begun %lld ms after the unlink "
                     "returned succeeded",
                     r, last - unlinked);
        assert_string_not_equal(status, "LLM_SUCCESS");
        th_sleep_ms(300); /* anything late would land meanwhile */
        for (uint32_t t = 0; t < 2; t++) {
            const uint8_t *m = (const uint8_t *)(uintptr_t)kv.tensor_addrs[t];
            for (uint64_t i = 0; i < size; i++)
                if (m[i] != 0xA5)
                    fail_msg("round %d: byte %llu of tensor %u written "
                             "after the unlink",
                             r, (unsigned long long)i, t);
        }
        for (uint32_t t = 0; t < 2; t++)
            memset((void *)(uintptr_t)kv.tensor_addrs[t], 0, size);
    }
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_unlink_ends_the_peers_access,
                                  teardown),
    };

    transport = argc > 1 ? argv[1] : "shm";
    return cmocka_run_group_tests_name("multiproc.unlink", tests, NULL, NULL);
}
