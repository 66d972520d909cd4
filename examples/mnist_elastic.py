"""The digits CNN of mnist_flax.py, trained elastically: a worker that is
lost does not end the job, and one that is started again joins it.

    jbps run -n 3 --min-workers 2 --max-workers 3 python examples/mnist_elastic.py

Kill one of the workers (kill -9 PID) while it trains: the others roll back to
their last commit and go on; `jbps run` starts it again and it joins them at
their next commit, taking the state from rank 0 (it runs its step once first,
in warm_up, while the others go on training). Every step takes the same
global batch, split over however many workers there are, so the training is
the same whatever happens to the workers. Prints the test accuracy.
"""

import argparse
import time

import jax
import numpy as np
import optax
from flax.training import train_state

import jbps
import jbps.elastic
from mnist_flax import CNN, accuracy, load_data, train_step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument(
        "--batch-size", type=int, default=60, help="global batch, split over the workers (60 splits 1-6 ways)"
    )
    p.add_argument("--commit-every", type=int, default=1, help="steps between commits")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    x_train, x_test, y_train, y_test = load_data(args.seed)
    steps_per_epoch = len(x_train) // args.batch_size
    total = args.epochs * steps_per_epoch
    model = CNN()
    params = model.init(jax.random.PRNGKey(args.seed), x_train[:1])["params"]
    tx = jbps.optax.distributed(optax.adam(2e-3), priority=jbps.forward_order(params))
    train = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # What training goes on from after a change: the TrainState (parameters, optimizer state,
    # its step count) and the loop's own step. Broadcast from rank 0 at a generation's start (after a
    # loss the survivors, holding the same commit, each go on from their own).
    state = jbps.elastic.State(train=train, step=0)

    def warm_up(state):
        # A worker that joins a running job runs its step once before it asks to join (a
        # rehearsal: its psums sum this worker's own gradients, nothing is sent), so the others do
        # not wait for its trace, compile and first run; jbps.size() here is the size the job will
        # have with it. The outputs are thrown away: returned, so that jbps waits for them.
        if args.batch_size % jbps.size() == 0:
            per_worker = args.batch_size // jbps.size()
            return train_step(state.train, x_train[:per_worker], y_train[:per_worker])

    @jbps.elastic.run(warm_up=warm_up)
    def fit(state):
        rank, workers = jbps.rank(), jbps.size()
        if args.batch_size % workers:
            raise SystemExit(f"--batch-size {args.batch_size} does not split over {workers} workers")
        per_worker = args.batch_size // workers
        if rank == 0:
            print(f"step {state.step}: training with {workers} workers", flush=True)
        while state.step < total:
            epoch, step = divmod(state.step, steps_per_epoch)
            order = np.random.default_rng([args.seed, epoch]).permutation(len(x_train))  # same on every worker
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            mine = batch[rank * per_worker : (rank + 1) * per_worker]
            state.train, loss = train_step(state.train, x_train[mine], y_train[mine])
            state.step += 1
            if state.step % args.commit_every == 0 or state.step == total:
                state.commit()
            if rank == 0 and state.step % steps_per_epoch == 0:
                print(f"epoch {state.step // steps_per_epoch}/{args.epochs}: loss {float(loss):.3f}", flush=True)
        return float(accuracy(state.train, x_test, y_test))

    start = time.perf_counter()
    test_accuracy = fit(state)
    print(f"{args.epochs} epochs in {time.perf_counter() - start:.1f} s; test accuracy {test_accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
