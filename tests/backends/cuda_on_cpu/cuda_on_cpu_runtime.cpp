// Test-only: the grid of cuda_on_cpu.h, run on one OS thread. Each CUDA thread is a
// fiber; a round resumes every waiting fiber of the block once (in thread order, or
// in an order shuffled by the launch's seed) up to its next barrier. A block whose
// threads do not all reach the same barrier is an error (on a GPU: a hang or worse).
#include <ucontext.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_on_cpu.h"

namespace sc_cpu {
sc_dim3 thread_idx, block_idx, block_dim, grid_dim;

namespace {
struct Fiber {
    ucontext_t context;
    bool done = false;
    bool waiting = false;
    int predicate = 0;
};

constexpr size_t kStack = 256 * 1024;
std::vector<Fiber> fibers;
std::vector<std::vector<char>> stacks;
ucontext_t scheduler;
Fiber* current = nullptr;
int barrier_result = 0;
const std::function<void()>* body = nullptr;
std::string error;

void entry() {
    (*body)();
    current->done = true;  // uc_link returns to the scheduler
}
}  // namespace

int barrier(int predicate) {
    current->waiting = true;
    current->predicate = predicate;
    swapcontext(&current->context, &scheduler);
    return barrier_result;
}

int run(unsigned int grid, unsigned int block, unsigned int seed, const std::function<void()>& fn) {
    error.clear();
    grid_dim = {grid, 1, 1};
    block_dim = {block, 1, 1};
    block_idx = thread_idx = {0, 0, 0};
    body = &fn;
    fibers.assign(block, Fiber());
    if (stacks.size() < block) stacks.resize(block, std::vector<char>(kStack));
    std::vector<unsigned int> order(block);
    std::iota(order.begin(), order.end(), 0u);
    std::mt19937 shuffle(seed);
    for (unsigned int b = 0; b < grid; ++b) {
        block_idx.x = b;
        for (unsigned int t = 0; t < block; ++t) {
            Fiber& f = fibers[t];
            f = Fiber();
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = stacks[t].data();
            f.context.uc_stack.ss_size = kStack;
            f.context.uc_link = &scheduler;
            makecontext(&f.context, entry, 0);
        }
        for (int round = 0;; ++round) {
            if (seed != 0) std::shuffle(order.begin(), order.end(), shuffle);
            for (unsigned int t : order) {
                Fiber& f = fibers[t];
                if (f.done) continue;
                f.waiting = false;
                thread_idx.x = t;
                current = &f;
                swapcontext(&scheduler, &f.context);
            }
            unsigned int done = 0, any = 0;
            for (const Fiber& f : fibers) {
                done += f.done;
                any |= f.waiting && f.predicate;
            }
            if (done == block) break;
            if (done != 0) {
                error = "block " + std::to_string(b) + ": " + std::to_string(done) + " of " +
                        std::to_string(block) + " threads returned while the others wait at barrier " +
                        std::to_string(round);
                return -1;
            }
            barrier_result = static_cast<int>(any);
        }
    }
    return 0;
}
}  // namespace sc_cpu

extern "C" const char* sc_cpu_error() { return sc_cpu::error.c_str(); }
