/*
 * Fuzz target: the option-value parsers of core/options.c and
 * llmdd__options_apply with arbitrary keys and values. The first byte picks
 * the parser. For options_apply the rest is a list of records
 * "<key selector byte><value>\n": selectors 0..7 name the known keys, any
 * other takes "key=value" from the record itself. Checks the contracts: a
 * parser writes its output only on success, a rejected apply leaves the
 * options untouched, and an accepted one leaves them in range.
 */
#include <string.h>

#include "core/internal.h"
#include "fuzz/fuzz.h"

#define INPUT_MAX 4096
#define RECORDS_MAX 16

static const char *const keys[] = {
    LLMDD_OPT_LISTEN,    LLMDD_OPT_DEVICE_ID,   LLMDD_OPT_WAIT_TIME,
    LLMDD_OPT_HOST_POOL, LLMDD_OPT_DEVICE_POOL, LLMDD_OPT_TRANSPORT,
    LLMDD_OPT_AUTH_TOKEN, LLMDD_OPT_MAX_LINKS,
};

static void
check_pool(const llmdd__pool_config *p)
{
    FUZZ_CHECK(p->page_shift >= 12 && p->page_shift <= 30);
    FUZZ_CHECK(p->memory_size > 0);
    FUZZ_CHECK(p->memory_size % (1ull << p->page_shift) == 0);
}

static void
check_opts(const llmdd__options *o)
{
    char name[96];

    FUZZ_CHECK(o->wait_ms >= 1 && o->wait_ms <= LLMDD_MAX_WAIT_MS);
    FUZZ_CHECK(o->device_id <= INT32_MAX);
    FUZZ_CHECK(o->max_links >= 1 && o->max_links <= LLMDD_MAX_LINKS_MAX);
    FUZZ_CHECK(strcmp(o->transport, "auto") == 0 ||
               llmdd__transport_known(o->transport));
    if (o->auth_token != NULL)
        FUZZ_CHECK(strlen(o->auth_token) >= 1 &&
                   strlen(o->auth_token) <= LLMDD_AUTH_TOKEN_MAX);
    if (o->host_pool)
        check_pool(&o->host_pool_config);
    if (o->device_pool)
        check_pool(&o->device_pool_config);
    if (o->listen) {
        llmdd__sockaddr_str(&o->listen_addr, name, sizeof(name));
        FUZZ_CHECK(name[0] != '?');
    }
}

/* Splits text into records and applies them; text is modified. */
static void
apply(llmdd__options *o, char *text, size_t len)
{
    llmdd_option opts[RECORDS_MAX];
    size_t n = 0;
    char *p = text, *end = text + len;

    while (p < end && n < RECORDS_MAX) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL)
            nl = end;
        *nl = '\0';
        unsigned sel = (unsigned char)*p;
        char *v = p + (p < nl ? 1 : 0);
        if (sel < sizeof(keys) / sizeof(keys[0])) {
            opts[n++] = (llmdd_option){keys[sel], v};
        } else {
            char *eq = strchr(v, '=');
            if (eq != NULL) {
                *eq = '\0';
                opts[n++] = (llmdd_option){v, eq + 1};
            } else {
                opts[n++] = (llmdd_option){v, v};
            }
        }
        p = nl + 1;
    }

    llmdd__options before = *o;
    char *token_before = o->auth_token ? strdup(o->auth_token) : NULL;
    llmdd_status st = llmdd__options_apply(o, opts, n);
    if (st != LLM_SUCCESS) {
        FUZZ_CHECK(memcmp(&before, o, sizeof(before)) == 0);
        FUZZ_CHECK((token_before == NULL) == (o->auth_token == NULL));
        if (token_before != NULL)
            FUZZ_CHECK(strcmp(token_before, o->auth_token) == 0);
    }
    free(token_before);
    check_opts(o);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char text[INPUT_MAX + 1];

    if (size < 1 || size - 1 > INPUT_MAX)
        return 0;
    size_t len = size - 1;
    memcpy(text, data + 1, len);
    text[len] = '\0';

    switch (data[0] % 6) {
    case 0: {
        llmdd__sockaddr a, z;
        memset(&a, 0x5a, sizeof(a));
        z = a;
        if (llmdd__parse_listen(text, &a) != LLM_SUCCESS) {
            FUZZ_CHECK(memcmp(&a, &z, sizeof(a)) == 0);
            break;
        }
        FUZZ_CHECK(a.addr.ss_family == AF_INET ||
                   a.addr.ss_family == AF_INET6);
        break;
    }
    case 1: {
        uint32_t v = 0;
        if (llmdd__parse_wait_time(text, &v) == LLM_SUCCESS)
            FUZZ_CHECK(v >= 1 && v <= LLMDD_MAX_WAIT_MS);
        else
            FUZZ_CHECK(v == 0);
        break;
    }
    case 2: {
        uint32_t v = 7;
        if (llmdd__parse_u32(text, &v) != LLM_SUCCESS)
            FUZZ_CHECK(v == 7);
        break;
    }
    case 3: {
        llmdd__pool_config p = {.memory_size = 7, .page_shift = 7};
        if (llmdd__parse_pool(text, &p) == LLM_SUCCESS)
            check_pool(&p);
        else
            FUZZ_CHECK(p.memory_size == 7 && p.page_shift == 7);
        break;
    }
    case 4: {
        /* An ip_info straight from a caller: any 64 bytes and a port. */
        llmdd_ip_info info;
        llmdd__sockaddr a;
        memset(&info, 0, sizeof(info));
        memcpy(info.ip, data + 1,
               len < sizeof(info.ip) ? len : sizeof(info.ip));
        info.port = (uint16_t)(len > 0 ? data[len] * 257u : 0);
        if (llmdd__parse_ip_info(&info, &a) == LLM_SUCCESS)
            FUZZ_CHECK(info.port != 0);
        break;
    }
    default: {
        /* Twice on one struct, so replacing a set token is covered too. */
        llmdd__options o;
        llmdd__options_init(&o);
        char copy[INPUT_MAX + 1];
        memcpy(copy, text, len + 1);
        apply(&o, text, len);
        apply(&o, copy, len);
        llmdd__options_fini(&o);
        break;
    }
    }
    return 0;
}
