/*
 * A stand-in for NVIDIA's pyxis SPANK plugin on the local test cluster (pyxis and enroot cannot be
 * installed here): when srun runs with LLMFT_TEST_PYXIS=1 in its environment, it accepts pyxis's
 * --container-image, --container-mounts, --container-workdir and --container-name (and lists them in
 * `srun --help`), and appends each value it received to the file named by the plugin argument log=PATH.
 * On each node of a step (slurmstepd), it does what pyxis does about creating the container: a step
 * with an image and no name creates one, a named container is created by the first step that names it
 * on that node and reused by the later ones; each creation appends
 * `container-created=<name or ->@<node>` to the log (the container itself is a marker file). The step
 * itself runs on the host: this tests what slurm/run_llm.slurm hands to pyxis, not containers. One thing
 * of a container it does stand in for: no Slurm client inside. A step with an image finds first on its PATH
 * a `squeue` that fails as a missing command would (exit 127) and appends `container-squeue-missing@<node>`
 * to the log each time it is asked.
 *
 *   gcc -shared -fPIC -o pyxis_standin.so tests/pyxis_standin.c      (needs libslurm-dev's spank.h)
 *   plugstack.conf:  optional /path/pyxis_standin.so log=/path/container-options.log
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <slurm/spank.h>

SPANK_PLUGIN(pyxis_standin, 1);

static char log_path[4096];
static char image[4096];
static char name[4096];

static void append(const char *line)
{
    int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);

    if (fd < 0)
        return;
    if (write(fd, line, strlen(line)) < 0) { /* best effort: the test reads what arrived */ }
    close(fd);
}

static int record(int val, const char *optarg, int remote)
{
    static const char *names[] = {"container-image", "container-mounts", "container-workdir", "container-name"};
    char line[8192];

    if (val < 0 || val > 3)
        return 0;
    if (remote) { /* slurmstepd: keep what creating the container needs */
        if (val == 0)
            snprintf(image, sizeof(image), "%s", optarg ? optarg : "");
        if (val == 3)
            snprintf(name, sizeof(name), "%s", optarg ? optarg : "");
        return 0;
    }
    if (!log_path[0])
        return 0;
    snprintf(line, sizeof(line), "%s=%s\n", names[val], optarg ? optarg : "");
    append(line); /* srun (local context) records what it was given */
    return 0;
}

static struct spank_option options[] = {
    {"container-image", "[USER@][REGISTRY#]IMAGE[:TAG]|PATH", "[pyxis stand-in] the image to run the step in", 1, 0, record},
    {"container-mounts", "SRC[:DST[:FLAGS]][,...]", "[pyxis stand-in] bind mounts, comma separated", 1, 1, record},
    {"container-workdir", "PATH", "[pyxis stand-in] working directory inside the container", 1, 2, record},
    {"container-name", "NAME", "[pyxis stand-in] name the container: created once per node, reused by later steps", 1, 3, record},
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
    for (i = 0; i < 4; i++)
        spank_option_register(sp, &options[i]);
    return 0;
}

/* Every task of a step with an image: PATH starts with a directory whose squeue answers as a missing one. */
static void without_slurm_client(spank_t sp, const char *node)
{
    char dir[4200], script[4300], tmp[4400], path[16384], newpath[20600];
    FILE *f;

    snprintf(dir, sizeof(dir), "%s.no-slurm-client", log_path);
    mkdir(dir, 0755);
    snprintf(script, sizeof(script), "%s/squeue", dir);
    snprintf(tmp, sizeof(tmp), "%s.%ld", script, (long) getpid());
    f = fopen(tmp, "w");
    if (f) { /* written whole, then renamed into place: tasks on one node may do this at once */
        fprintf(f, "#!/bin/sh\necho \"container-squeue-missing@%s\" >> '%s'\n"
                   "echo 'squeue: command not found (no Slurm client in the container)' >&2\nexit 127\n",
                node, log_path);
        fclose(f);
        chmod(tmp, 0755);
        rename(tmp, script);
    }
    if (spank_getenv(sp, "PATH", path, sizeof(path)) != ESPANK_SUCCESS)
        path[0] = 0;
    snprintf(newpath, sizeof(newpath), "%s:%s", dir, path);
    spank_setenv(sp, "PATH", newpath, 1);
}

/* On each node of a step, once (in its first task, where the task's environment names the node): create the
 * container unless this node has the named one already. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    char node[256] = "", marker[8800], line[8800], dir[4200];
    uint32_t nodeid = 0;
    struct stat st;
    int fd;

    (void) ac;
    (void) av;
    if (spank_context() != S_CTX_REMOTE || !image[0] || !log_path[0])
        return 0;
    if (spank_getenv(sp, "SLURMD_NODENAME", node, sizeof(node)) != ESPANK_SUCCESS || !node[0]) {
        spank_get_item(sp, S_JOB_NODEID, &nodeid);
        snprintf(node, sizeof(node), "nodeid%u", nodeid);
    }
    without_slurm_client(sp, node);
    if (name[0]) {
        snprintf(dir, sizeof(dir), "%s.containers", log_path);
        mkdir(dir, 0755);
        snprintf(marker, sizeof(marker), "%s/%s@%s", dir, name, node);
        if (stat(marker, &st) == 0)
            return 0; /* reused */
        fd = open(marker, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (fd < 0)
            return 0; /* another task of this step created it */
        close(fd);
    }
    snprintf(line, sizeof(line), "container-created=%s@%s\n", name[0] ? name : "-", node);
    append(line);
    return 0;
}
