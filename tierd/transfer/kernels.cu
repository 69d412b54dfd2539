// tierd's GPU kernels, compiled at run time (cupy.RawModule, NVRTC).
//
// Every kernel is free of shared memory and barriers, so the test suite can
// compile this same file as C++ on a machine without a GPU and run each
// thread of the grid in turn (tests/transfer/test_kernels.py).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef long long i64;

// ---------------------------------------------------------------------------
// Batched 2-D copy: a gather or scatter of any number of runs in one launch.
//
// plan holds n entries of 6 words: src, dst (addresses the GPU can reach:
// device memory or pinned, mapped host memory), src_pitch, dst_pitch, width,
// rows. Entry e copies rows rows of width bytes. The planner keeps entries
// small enough that one thread block per entry spreads the work.

__device__ __forceinline__ void copy_entry(const u64* c) {
    const unsigned char* src = (const unsigned char*)c[0];
    unsigned char* dst = (unsigned char*)c[1];
    const u64 sp = c[2], dp = c[3], width = c[4], rows = c[5];
    if (((c[0] | c[1] | sp | dp | width) & 15) == 0) {  // 16-byte aligned: vector loads and stores
        const u64 per_row = width >> 4;
        for (u64 r = 0; r < rows; r++) {
            const uint4* s = (const uint4*)(src + r * sp);
            uint4* d = (uint4*)(dst + r * dp);
            for (u64 k = threadIdx.x; k < per_row; k += blockDim.x) d[k] = s[k];
        }
    } else {
        for (u64 r = 0; r < rows; r++) {
            const unsigned char* s = src + r * sp;
            unsigned char* d = dst + r * dp;
            for (u64 k = threadIdx.x; k < width; k += blockDim.x) d[k] = s[k];
        }
    }
}

extern "C" __global__ void tierd_copy2d(const u64* plan, i64 n) {
    for (i64 e = blockIdx.x; e < n; e += gridDim.x) copy_entry(plan + 6 * e);
}

// ---------------------------------------------------------------------------
// XXH3-64 (seed 0) of pages longer than 240 bytes, the same value as the CPU's
// xxhash.xxh3_64. The long hash keeps 8 accumulators; accumulator i only
// ever reads the input words i and i ^ 1 of each 64-byte stripe, so each is
// computed by its own thread (tierd_xxh3_lanes), and a second launch merges
// the 8 of each page (tierd_xxh3_merge).

#define P32_1 0x9E3779B1ULL
#define P32_2 0x85EBCA77ULL
#define P32_3 0xC2B2AE3DULL
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define SECRET_SIZE 192
#define STRIPE 64
#define BLOCK 1024  // 16 stripes between scrambles: (SECRET_SIZE - STRIPE) / 8

__constant__ unsigned char XXH3_SECRET[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

// Little-endian 64-bit read at any alignment (the secret's offsets are not all 8-aligned).
__device__ __forceinline__ u64 read64(const unsigned char* p) {
    u64 v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

// A page word: pages start 4 KiB-aligned, so all but the last stripe read aligned words.
__device__ __forceinline__ u64 load64(const unsigned char* p) {
    return ((u64)p & 7) == 0 ? *(const u64*)p : read64(p);
}

// One accumulator's step over one stripe: its own word keyed and multiplied,
// plus its neighbour's word unkeyed.
__device__ __forceinline__ u64 stripe_lane(u64 acc, u64 own, u64 neighbour, u64 key) {
    const u64 k = own ^ key;
    return acc + neighbour + (k & 0xFFFFFFFFULL) * (k >> 32);
}

__device__ u64 xxh3_lane(const unsigned char* in, u64 len, int lane) {
    const u64 init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    u64 acc = init[lane];
    const int own = 8 * lane, other = 8 * (lane ^ 1);
    const u64 blocks = (len - 1) / BLOCK;
    const u64 scramble_key = read64(XXH3_SECRET + SECRET_SIZE - STRIPE + own);
    u64 keys[BLOCK / STRIPE];
#pragma unroll
    for (int s = 0; s < BLOCK / STRIPE; s++) keys[s] = read64(XXH3_SECRET + 8 * s + own);
    for (u64 b = 0; b < blocks; b++) {
        const unsigned char* p = in + b * BLOCK;
#pragma unroll
        for (int s = 0; s < BLOCK / STRIPE; s++)
            acc = stripe_lane(acc, load64(p + s * STRIPE + own), load64(p + s * STRIPE + other), keys[s]);
        acc ^= acc >> 47;
        acc ^= scramble_key;
        acc *= P32_1;
    }
    const unsigned char* tail = in + blocks * BLOCK;
    const u64 stripes = ((len - 1) - blocks * BLOCK) / STRIPE;
    for (u64 s = 0; s < stripes; s++)
        acc = stripe_lane(acc, load64(tail + s * STRIPE + own), load64(tail + s * STRIPE + other), keys[s]);
    const unsigned char* last = in + len - STRIPE;  // the last stripe, overlapping the one before
    return stripe_lane(acc, load64(last + own), load64(last + other),
                       read64(XXH3_SECRET + SECRET_SIZE - STRIPE - 7 + own));
}

__device__ __forceinline__ u64 mul128_fold64(u64 a, u64 b) {
#ifdef __CUDA_ARCH__
    return (a * b) ^ __umul64hi(a, b);
#else
    const unsigned __int128 p = (unsigned __int128)a * b;
    return (u64)p ^ (u64)(p >> 64);
#endif
}

__device__ u64 xxh3_merge(const u64* acc, u64 len) {
    u64 h = len * P64_1;
    for (int i = 0; i < 4; i++)
        h += mul128_fold64(acc[2 * i] ^ read64(XXH3_SECRET + 11 + 16 * i),
                           acc[2 * i + 1] ^ read64(XXH3_SECRET + 11 + 16 * i + 8));
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    h ^= h >> 32;
    return h;
}

// pages holds n (address, length) pairs, every length > 240; accs gets 8 words a page.
extern "C" __global__ void tierd_xxh3_lanes(const u64* pages, i64 n, u64* accs) {
    const i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (t >= 8 * n) return;
    const i64 page = t >> 3;
    accs[t] = xxh3_lane((const unsigned char*)pages[2 * page], pages[2 * page + 1], (int)(t & 7));
}

extern "C" __global__ void tierd_xxh3_merge(const u64* pages, i64 n, const u64* accs, u64* out) {
    const i64 page = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (page >= n) return;
    out[page] = xxh3_merge(accs + 8 * page, pages[2 * page + 1]);
}
