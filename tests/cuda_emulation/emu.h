// CPU emulation of the CUDA execution model, for testing csrc/*.cu without a GPU (tests only).
//
// Force-included (g++ -include emu.h) before each kernel source whose launches
// `k<<<grid, block, shmem, stream>>>(args)` build.py has rewritten to
// `emu_launch("k", [&] { k(args); }, grid, block, shmem, stream)`.
//
// Model: a launch runs its blocks one after another (in order, or in reverse when the
// schedule is reversed). A block's threads are fibers on the calling OS thread, each with
// its own stack (switched by a few instructions of assembly, or by ucontext where that is
// unavailable or a shadow stack is active, see below). The scheduler runs each live thread
// until it reaches __syncthreads() or returns, then the next one, in thread order (or
// reverse). When every thread of the block waits at the barrier they all proceed; if some
// wait while others have returned, that is a divergent barrier (undefined behaviour in
// CUDA): the launch fails with cudaErrorLaunchFailure and a message. __shared__ variables
// become statics, shared by the fibers of the running block, one block at a time. So a
// missing __syncthreads() shows up as a wrong result (threads run in sequence, so the first
// thread reads what the others have not written yet, or overwrites what they have not read
// yet), and the result is the same in both schedules when the barriers are right: the
// tests compare the two bitwise.
//
// Not modelled: concurrency between blocks and between the threads of a block (nothing
// runs at the same time, so neither the memory model nor atomics nor warp-synchronous code
// is tested), resource limits (registers, shared memory size: the nvcc compile test checks
// those), streams (launches are synchronous) and FMA contraction (built with
// -ffp-contract=off, so results agree with the GPU's to rounding, not bit for bit).
//
// Shared memory starts each block as garbage on a GPU (whatever the SM held last, NaN and Inf
// patterns included), not as a static's zeros or the last block's values: build.py follows
// every __shared__ declaration with poison_shared(), which fills the array with 0xFF bytes (a
// NaN in float and double) once per block, so a read of an element the block never wrote
// shows (NaN · 0 = NaN, where a zero or a stale finite value times 0 would hide it).
#pragma once

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <cstring>
#include <type_traits>
#include <unordered_map>

#include <cuda_runtime_api.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

// The built-in variables. threadIdx is rewritten by the scheduler every time it resumes a
// fiber; kernel code reads it as a global, so every read sees the running thread's value
// (a read cannot be cached across __syncthreads(), which calls out of line).
inline uint3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0};
inline dim3 blockDim, gridDim;

// Switching between fibers: a few instructions of assembly (glue.cpp) on x86-64 and AArch64
// Linux, else ucontext (whose swapcontext costs a system call per switch). ucontext is also
// used where a hardware shadow stack is active, which the hand-made switch would violate.
#if defined(__ELF__) && (defined(__x86_64__) || defined(__aarch64__))
#define FGD_EMU_ASM_SWITCH 1
extern "C" void fgd_emu_switch(void** save_sp, void* to_sp);  // glue.cpp
#else
#define FGD_EMU_ASM_SWITCH 0
#endif

namespace emu {

constexpr unsigned kMaxThreads = 1024;
constexpr size_t kStackBytes = 256 * 1024;  // per fiber; a PROT_NONE guard page below each

enum State : unsigned char { kRunnable, kAtBarrier, kDone };

struct Fiber {
    void* sp;  // saved stack pointer (assembly switch)
    ucontext_t ctx;  // saved context (ucontext switch)
    State state;
};

// Launch statistics (read by the tests through glue.cpp).
inline long long stat_launches = 0, stat_blocks = 0, stat_barriers = 0;
inline bool reverse_schedule = false;

// Shared memory: a number per block run (emu_launch), and the block that last poisoned each
// __shared__ array (by address): the first of a block's threads to reach the declaration
// fills it, the others find it filled (they may have written to it since).
inline unsigned long long block_serial = 0;
inline std::unordered_map<const void*, unsigned long long> poisoned_in;

inline void poison_shared(void* array, size_t bytes) {
    unsigned long long& last = poisoned_in[array];
    if (last == block_serial) return;
    std::memset(array, 0xFF, bytes);
    last = block_serial;
}

inline bool shadow_stack_active() {
    unsigned long status = 0;
    if (prctl(74 /* PR_GET_SHADOW_STACK_STATUS */, &status, 0, 0, 0) == 0 && (status & 1)) return true;
#if defined(__x86_64__)
    status = 0;
    if (syscall(SYS_arch_prctl, 0x5005 /* ARCH_SHSTK_STATUS */, &status) == 0 && (status & 1)) return true;
#endif
    return false;
}

inline bool use_ucontext = !FGD_EMU_ASM_SWITCH || shadow_stack_active();

inline std::mutex launch_mutex;  // one launch at a time: the state below is global
inline void* scheduler_sp = nullptr;
inline ucontext_t scheduler;
inline Fiber fibers[kMaxThreads];
inline unsigned current = 0;
inline void (*body_call)(void*) = nullptr;
inline void* body_obj = nullptr;
inline char* stacks = nullptr;
inline size_t stack_stride = 0;

// A memory fault inside a thread (glue.cpp's SIGSEGV/SIGBUS handler) abandons the thread,
// writes fault_message and returns to the scheduler, which fails the launch with
// fault_code: cudaErrorIllegalAddress (the tests' buffers end at an inaccessible page, so a
// read or write past the end of one is reported like that instead of killing the process),
// or cudaErrorLaunchTimeout (the watchdog below).
inline volatile sig_atomic_t in_fiber = 0, faulted = 0;
inline cudaError_t fault_code = cudaSuccess;
inline char fault_message[512];

inline void switch_to_fiber(unsigned t) {
    in_fiber = 1;
#if FGD_EMU_ASM_SWITCH
    if (!use_ucontext) fgd_emu_switch(&scheduler_sp, fibers[t].sp);
    else
#endif
        swapcontext(&scheduler, &fibers[t].ctx);
    in_fiber = 0;
}

inline void switch_to_scheduler() {
    Fiber& f = fibers[current];
#if FGD_EMU_ASM_SWITCH
    if (!use_ucontext) return fgd_emu_switch(&f.sp, scheduler_sp);
#endif
    swapcontext(&f.ctx, &scheduler);
}

inline void fiber_main() {
    body_call(body_obj);
    fibers[current].state = kDone;
    switch_to_scheduler();  // never resumed
    abort();
}

inline bool allocate_stacks() {
    if (stacks) return true;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    stack_stride = kStackBytes + page;
    void* mem = mmap(nullptr, stack_stride * kMaxThreads, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return false;
    stacks = static_cast<char*>(mem);
    for (unsigned t = 0; t < kMaxThreads; ++t) mprotect(stacks + t * stack_stride, page, PROT_NONE);  // overflow faults
    return true;
}

// A fresh fiber t that starts in fiber_main when first switched to.
inline void make_fiber(unsigned t) {
    Fiber& f = fibers[t];
    char* base = stacks + t * stack_stride + (stack_stride - kStackBytes);
    f.state = kRunnable;
#if FGD_EMU_ASM_SWITCH
    if (!use_ucontext) {
        // the frame fgd_emu_switch pops (see glue.cpp), "returning" into fiber_main with the
        // stack aligned as after a call
        auto* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(base + kStackBytes) & ~uintptr_t(15));
#if defined(__x86_64__)
        uint64_t* sp = top - 9;  // [mxcsr | x87 cw] r15 r14 r13 r12 rbx rbp ret 0
        for (int i = 0; i < 9; ++i) sp[i] = 0;
        sp[0] = 0x1f80u | (uint64_t)0x037fu << 32;  // default MXCSR and x87 control word
        sp[7] = reinterpret_cast<uint64_t>(&fiber_main);  // the ret slot is 16-byte aligned
#else
        uint64_t* sp = top - 22;  // x19 … x28, x29, x30, d8 … d15, fpcr, pad (176 bytes)
        for (int i = 0; i < 22; ++i) sp[i] = 0;
        sp[11] = reinterpret_cast<uint64_t>(&fiber_main);  // x30: where ret goes
#endif
        f.sp = sp;
        return;
    }
#endif
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = base;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
}

inline unsigned order(unsigned i, unsigned count) { return reverse_schedule ? count - 1 - i : i; }

// Run one block to completion; false (and the error recorded) on a divergent barrier, a
// fault or a timeout.
inline bool run_block(const char* kernel, unsigned nthreads) {
    for (unsigned t = 0; t < nthreads; ++t) make_fiber(t);
    for (;;) {
        for (unsigned i = 0; i < nthreads; ++i) {
            const unsigned t = order(i, nthreads);
            if (fibers[t].state != kRunnable) continue;
            current = t;
            threadIdx = {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
            switch_to_fiber(t);
            if (faulted) {
                faulted = 0;
                fail(fault_code, fault_message);
                return false;  // the other fibers are abandoned too
            }
        }
        unsigned waiting = 0;
        for (unsigned t = 0; t < nthreads; ++t) waiting += fibers[t].state == kAtBarrier;
        if (waiting == 0) return true;  // every thread returned
        if (waiting != nthreads) {
            fail(cudaErrorLaunchFailure,
                 std::string("emulator: divergent __syncthreads() in ") + kernel + ", block (" +
                     std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " +
                     std::to_string(blockIdx.z) + "): " + std::to_string(waiting) + " of " +
                     std::to_string(nthreads) + " threads wait at a barrier the others never reach");
            return false;  // the waiting fibers are abandoned (their stacks hold no live objects)
        }
        ++stat_barriers;
        for (unsigned t = 0; t < nthreads; ++t) fibers[t].state = kRunnable;
    }
}

template <class F>
void call(void* f) {
    (*static_cast<F*>(f))();
}

// A kernel stuck in an endless loop would hang the test run, and no barrier comes to take
// control back: a watchdog thread interrupts a launch that runs longer than
// FGD_EMU_LAUNCH_TIMEOUT seconds (default 60; the tests' launches take well under one) with
// SIGXCPU, whose handler (glue.cpp) abandons the running thread like a memory fault and
// fails the launch with cudaErrorLaunchTimeout. Should that not end it (the thread is not in
// kernel code), the watchdog aborts the process after twice the time, saying why on stderr.
inline std::atomic<const char*> running_kernel{nullptr};
inline std::atomic<long long> running_since{0};  // steady clock, ns; 0 when no launch runs
inline std::atomic<double> launch_timeout{0.0};
inline pthread_t launch_thread;

inline long long now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

inline void start_watchdog() {
    static std::once_flag once;
    std::call_once(once, [] {
        if (launch_timeout.load() <= 0) {
            const char* env = std::getenv("FGD_EMU_LAUNCH_TIMEOUT");
            launch_timeout = env && std::atof(env) > 0 ? std::atof(env) : 60.0;
        }
        std::thread([] {
            long long interrupted = 0;  // the launch (its start time) already sent SIGXCPU
            for (;;) {
                std::this_thread::sleep_for(std::chrono::milliseconds(100));
                const long long since = running_since.load();
                const double limit = launch_timeout.load(), elapsed = (double)(now_ns() - since) * 1e-9;
                if (!since || elapsed <= limit) continue;
                if (interrupted != since) {
                    interrupted = since;
                    pthread_kill(launch_thread, SIGXCPU);
                } else if (elapsed > 2 * limit + 1) {
                    std::fprintf(stderr, "\nfgd_fast CUDA emulator: %s has run for more than %g s and cannot be "
                                 "interrupted: aborting.\n", running_kernel.load(), elapsed);
                    std::fflush(stderr);
                    std::abort();
                }
            }
        }).detach();
    });
}

// Whether stack pointer `sp` (of an interrupted context) is on the running thread's stack.
inline bool on_fiber_stack(uintptr_t sp) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(stacks) + current * stack_stride;
    return in_fiber && stacks && sp > lo && sp <= lo + stack_stride;
}

}  // namespace emu

inline void __syncthreads() {
    emu::fibers[emu::current].state = emu::kAtBarrier;
    emu::switch_to_scheduler();
}

// The rewritten `kernel<<<grid, block, shmem, stream>>>(args)`, `body` calling kernel(args):
// check the configuration as the driver would, then run every block. Errors are left for
// cudaGetLastError().
template <class F>
void emu_launch(const char* kernel, F&& body, dim3 grid, dim3 block, size_t shmem = 0, cudaStream_t stream = nullptr) {
    (void)stream;
    const std::lock_guard<std::mutex> lock(emu::launch_mutex);
    const unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
    if (nthreads == 0 || nthreads > emu::kMaxThreads || block.z > 64 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 || shmem > 48 * 1024) {
        emu::fail(cudaErrorInvalidConfiguration,
                  std::string("emulator: invalid launch configuration for ") + kernel + ": grid (" +
                      std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " + std::to_string(grid.z) +
                      ") block (" + std::to_string(block.x) + ", " + std::to_string(block.y) + ", " +
                      std::to_string(block.z) + ")");
        return;
    }
    if (!emu::allocate_stacks()) {
        emu::fail(cudaErrorLaunchFailure, "emulator: cannot allocate fiber stacks");
        return;
    }
    emu::start_watchdog();
    ++emu::stat_launches;
    gridDim = grid;
    blockDim = block;
    emu::body_call = &emu::call<std::remove_reference_t<F>>;
    emu::body_obj = const_cast<void*>(static_cast<const void*>(&body));
    emu::running_kernel = kernel;
    emu::launch_thread = pthread_self();
    emu::running_since = emu::now_ns();
    const unsigned long long nblocks = (unsigned long long)grid.x * grid.y * grid.z;
    for (unsigned long long i = 0; i < nblocks; ++i) {
        const unsigned long long b = emu::reverse_schedule ? nblocks - 1 - i : i;
        blockIdx = {(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / grid.x / grid.y)};
        ++emu::stat_blocks;
        ++emu::block_serial;  // (its shared memory is poisoned afresh)
        if (!emu::run_block(kernel, (unsigned)nthreads)) break;
    }
    emu::running_since = 0;
}
