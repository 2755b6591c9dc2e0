// The storage stage's bound without the plugin: T threads pread pieces of one size from a cached
// file into a per-thread ring of destination memory, as the page-cache workers read into staging
// buffers. Prints GB/s. Issue 26 item 4: tells whether small scattered READs wait for the page
// cache's copy rate or for the plugin's own hand-offs.
//
//   gcc -O2 -static -pthread -o pread_bound bench/pread_bound.c
//   ./pread_bound FILE THREADS PIECE BYTES_PER_PASS DEST_RING RANDOM NOWAIT [PASSES]
//
// FILE should be cached (read it once first). RANDOM=1: piece-aligned random file offsets
// (xorshift), 0: each thread reads its own consecutive range. NOWAIT=1: preadv2(RWF_NOWAIT), as
// the plugin's workers try first. DEST_RING: bytes of destination memory per thread, written
// in order and wrapped.
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static int fd, random_offsets, nowait, passes;
static size_t file_size, piece, per_thread, ring;
static pthread_barrier_t start_stop;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *reader(void *arg) {
    long id = (long)arg;
    char *dst = mmap(0, ring, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (dst == MAP_FAILED) { perror("mmap"); exit(1); }
    uint64_t x = 88172645463325252ULL + (uint64_t)id * 7919;
    size_t blocks = file_size / piece, n = per_thread / piece;
    pthread_barrier_wait(&start_stop);
    for (int p = 0; p < passes; p++) {
        for (size_t i = 0; i < n; i++) {
            size_t off;
            if (random_offsets) {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                off = (x % blocks) * piece;
            } else {
                off = ((id * n + i) % blocks) * piece;
            }
            char *d = dst + (i * piece) % ring;
            ssize_t r;
            if (nowait) {
                struct iovec v = {d, piece};
                r = preadv2(fd, &v, 1, off, RWF_NOWAIT);
            } else {
                r = pread(fd, d, piece, off);
            }
            if (r != (ssize_t)piece) { perror("pread (is the file cached and large enough?)"); exit(1); }
        }
    }
    pthread_barrier_wait(&start_stop);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: %s FILE THREADS PIECE BYTES_PER_PASS DEST_RING RANDOM NOWAIT [PASSES]\n", argv[0]);
        return 2;
    }
    fd = open(argv[1], O_RDONLY);
    if (fd < 0) { perror(argv[1]); return 1; }
    file_size = lseek(fd, 0, SEEK_END);
    int threads = atoi(argv[2]);
    piece = strtoul(argv[3], 0, 0);
    size_t total = strtoul(argv[4], 0, 0);
    ring = strtoul(argv[5], 0, 0);
    random_offsets = atoi(argv[6]);
    nowait = atoi(argv[7]);
    passes = argc > 8 ? atoi(argv[8]) : 5;
    if (threads < 1 || threads > 256 || piece == 0 || ring < piece || file_size < piece) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    per_thread = total / threads;
    pthread_barrier_init(&start_stop, 0, threads + 1);
    pthread_t th[256];
    for (long i = 0; i < threads; i++) pthread_create(&th[i], 0, reader, (void *)i);
    pthread_barrier_wait(&start_stop);
    double t0 = now();
    pthread_barrier_wait(&start_stop);
    double t = now() - t0;
    for (int i = 0; i < threads; i++) pthread_join(th[i], 0);
    printf("threads %d piece %zu %s nowait %d: %.2f GB/s (%.3f ms per %zu MiB)\n", threads, piece,
           random_offsets ? "random" : "sequential", nowait, (double)per_thread * threads * passes / t / 1e9,
           t / passes * 1e3, (per_thread * threads) >> 20);
    return 0;
}
