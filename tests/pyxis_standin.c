/*
 * A stand-in for NVIDIA's pyxis SPANK plugin on the local test cluster (pyxis and enroot cannot be
 * installed here): when srun runs with LLMFT_TEST_PYXIS=1 in its environment, it accepts pyxis's
 * --container-image, --container-mounts and --container-workdir (and lists them in `srun --help`),
 * and appends each value it received to the file named by the plugin argument log=PATH. The step
 * itself runs on the host: this tests what slurm/run_llm.slurm hands to pyxis, not containers.
 *
 *   gcc -shared -fPIC -o pyxis_standin.so tests/pyxis_standin.c      (needs libslurm-dev's spank.h)
 *   plugstack.conf:  optional /path/pyxis_standin.so log=/path/container-options.log
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <slurm/spank.h>

SPANK_PLUGIN(pyxis_standin, 1);

static char log_path[4096];

static int record(int val, const char *optarg, int remote)
{
    static const char *names[] = {"container-image", "container-mounts", "container-workdir"};
    char line[8192];
    int fd, n;

    if (remote || !log_path[0] || val < 0 || val > 2)
        return 0; /* srun (local context) records; slurmstepd only accepts the option */
    n = snprintf(line, sizeof(line), "%s=%s\n", names[val], optarg ? optarg : "");
    fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0)
        return 0;
    if (write(fd, line, (size_t) n) < 0) { /* best effort: the test reads what arrived */ }
    close(fd);
    return 0;
}

static struct spank_option options[] = {
    {"container-image", "[USER@][REGISTRY#]IMAGE[:TAG]|PATH", "[pyxis stand-in] the image to run the step in", 1, 0, record},
    {"container-mounts", "SRC[:DST[:FLAGS]][,...]", "[pyxis stand-in] bind mounts, comma separated", 1, 1, record},
    {"container-workdir", "PATH", "[pyxis stand-in] working directory inside the container", 1, 2, record},
};

int slurm_spank_init(spank_t sp, int ac, char **av)
{
    const char *enabled = getenv("LLMFT_TEST_PYXIS");
    int i;

    for (i = 0; i < ac; i++)
        if (strncmp(av[i], "log=", 4) == 0)
            snprintf(log_path, sizeof(log_path), "%s", av[i] + 4);
    /* srun offers the options only where a test asked for them; slurmstepd always accepts them. */
    if (spank_context() == S_CTX_LOCAL && !(enabled && strcmp(enabled, "1") == 0))
        return 0;
    if (spank_context() != S_CTX_LOCAL && spank_context() != S_CTX_REMOTE)
        return 0;
    for (i = 0; i < 3; i++)
        spank_option_register(sp, &options[i]);
    return 0;
}
