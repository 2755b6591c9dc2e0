// One page-cache worker's copy without the plugin: one thread pwrite()s (or pread()s) pieces
// between a staging-like pool and a cached file, cycling through WINDOW bytes of the pool, with
// the pool on 4 KiB pages and on transparent huge pages (mapped as src/mem/huge_pages.rs maps
// the staging pool), alternated ROUNDS times. Prints GB/s per run and the pool's AnonHugePages.
//
//   gcc -O2 -o staging_copy_bound bench/staging_copy_bound.c
//   dd if=/dev/urandom of=/var/tmp/scb bs=1M count=1024 && sync   # a cached, written-back file
//   ./staging_copy_bound /var/tmp/scb write|read PIECE WINDOW [ROUNDS] [SECONDS]
//
// The pool is 64 MiB (the staging pool's default: 32 buffers of 2 MiB); offsets in the file are
// random multiples of PIECE (xorshift, the same sequence for every run).
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define POOL (64UL << 20)
#define HUGE (2UL << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static long huge_kb(void) {  // AnonHugePages of the whole process (the pool is its only big mapping)
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "AnonHugePages:", 14)) kb = atol(line + 14);
    if (f) fclose(f);
    return kb;
}

static double run(int fd, int write, int huge, size_t piece, size_t window, double seconds, long *kb) {
    char *raw = mmap(0, POOL + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) { perror("mmap"); exit(1); }
    char *pool = (char *)(((uintptr_t)raw + HUGE - 1) & ~(HUGE - 1));
    madvise(pool, POOL, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(pool, 0x5a, POOL);
    *kb = huge_kb();
    size_t blocks = (size_t)lseek(fd, 0, SEEK_END) / piece, at = 0, bytes = 0;
    uint64_t x = 88172645463325252ULL;
    double t0 = now(), t;
    do {
        for (int k = 0; k < 32; k++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            off_t off = (off_t)(x % blocks) * piece;
            ssize_t n = write ? pwrite(fd, pool + at, piece, off) : pread(fd, pool + at, piece, off);
            if (n != (ssize_t)piece) { perror(write ? "pwrite" : "pread"); exit(1); }
            at = (at + piece) % window;
            bytes += piece;
        }
    } while ((t = now() - t0) < seconds);
    munmap(raw, POOL + HUGE);
    return bytes / t / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s FILE write|read PIECE WINDOW [ROUNDS] [SECONDS]\n", argv[0]);
        return 2;
    }
    int write = !strcmp(argv[2], "write");
    size_t piece = strtoul(argv[3], 0, 0), window = strtoul(argv[4], 0, 0);
    int rounds = argc > 5 ? atoi(argv[5]) : 3;
    double seconds = argc > 6 ? atof(argv[6]) : 2.0;
    int fd = open(argv[1], write ? O_RDWR : O_RDONLY);
    if (fd < 0) { perror(argv[1]); return 1; }
    if (piece == 0 || window < piece || window > POOL || window % piece) {
        fprintf(stderr, "PIECE must divide WINDOW, and WINDOW be at most %lu\n", POOL);
        return 2;
    }
    for (int r = 0; r < rounds; r++) {
        for (int huge = 0; huge < 2; huge++) {
            int h = r % 2 ? 1 - huge : huge;  // alternate which page size runs first
            long kb;
            double gbs = run(fd, write, h, piece, window, seconds, &kb);
            printf("%s piece %zu window %zu round %d %s pages: %.2f GB/s (AnonHugePages %ld kB)\n",
                   argv[2], piece, window, r + 1, h ? "huge" : "4 KiB", gbs, kb);
            fflush(stdout);
        }
    }
    return 0;
}
