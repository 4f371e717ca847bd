/* One harness's entry point in the tools bundle: exec a fixed argv prefix plus the caller's arguments.
 *
 * Built statically, once per harness, by build_tools.py with TOOL_ARGV set to that harness's prefix
 * (its runtime and script, or the bundle's dynamic loader and its binary), so it runs in any image:
 * no libc, shell or /usr/bin/env needed. It sets no environment variable: nothing leaks into what
 * the harness runs.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const prefix[] = {TOOL_ARGV};

int main(int argc, char **argv) {
    size_t n = sizeof prefix / sizeof *prefix;
    char **args = calloc(n + (size_t)argc, sizeof *args);
    if (args == NULL) {
        fputs("orchard tools: out of memory\n", stderr);
        return 127;
    }
    for (size_t i = 0; i < n; i++) args[i] = (char *)prefix[i];
    for (int i = 1; i < argc; i++) args[n + (size_t)i - 1] = argv[i];
    execv(args[0], args);
    fprintf(stderr, "orchard tools: cannot run %s: %s\n", args[0], strerror(errno));
    return 127;
}
