"""Muon for FSDP2: torch.optim.Muon's update, each matrix orthogonalized whole on one rank.

Under FSDP2 every matrix is a DTensor split by rows over the ranks (Shard(0)). torch.optim.Muon
runs Newton-Schulz on those DTensors, and nearly every matmul of every iteration redistributes:
about 13 collectives per matrix per step. ShardedMuon makes two a step, however many matrices and
Newton-Schulz iterations there are. Each matrix has an owner rank; one all-to-all sends every
rank's rows of each matrix to its owner, the owner orthogonalizes its matrices whole, and a second
all-to-all sends every rank its rows of the updates. The rest of the step (momentum, weight decay,
the update itself) is elementwise and runs on each rank's own rows.

The numbers are torch.optim.Muon's: the same hyperparameters, Newton-Schulz in bf16 with the same
operations, and the momentum kept as the state "momentum_buffer", a DTensor sharded as its
parameter, so a checkpoint saves it per parameter name and a resume on another world size
reshards it. On one process (plain tensors) a step is torch.optim.Muon's, bit for bit.
"""
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def newton_schulz(matrix, coefficients, steps, eps):
    """The orthogonal factor of `matrix`, approximately, in bf16: torch.optim.Muon's quintic
    iteration, operation for operation, so that the result is the same to the last bit."""
    a, b, c = coefficients
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix is then the smaller one
        x = x.T
    # The spectral norm at most 1. Out of place: bfloat16() of a bf16 matrix is the caller's own.
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if tall:
        x = x.T
    return x


def adjusted_lr(lr, adjust_lr_fn, shape):
    """torch.optim.Muon's learning rate for a matrix of `shape`, its rounding included."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))  # Keller Jordan's: tall matrices step further
    return lr * (0.2 * math.sqrt(max(rows, cols)))  # "match_rms_adamw", Moonshot's


def shard_rows(num_rows, world_size):
    """Each rank's (first row, end row) of a matrix sharded as Shard(0) shards it: torch.chunk's
    split, in which the last ranks may hold fewer rows or none."""
    chunk = -(-num_rows // world_size)
    return [(min(rank * chunk, num_rows), min((rank + 1) * chunk, num_rows))
            for rank in range(world_size)]


def assign_owners(shapes, world_size):
    """The rank that orthogonalizes each matrix: the largest first, each to the rank with the least
    Newton-Schulz work so far (about rows x cols x min(rows, cols) multiply-adds)."""
    cost = [rows * cols * min(rows, cols) for rows, cols in shapes]
    load, owners = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -cost[i]):
        owners[i] = min(range(world_size), key=lambda rank: load[rank])
        load[owners[i]] += cost[i]
    return owners


def all_to_all(send, receive_shapes, process_group):
    """Send the tensors of send[r] to rank r and receive tensors of receive_shapes[r] from rank r,
    in one all-to-all of one flat buffer (every tensor of one dtype)."""
    send_sizes = [sum(t.numel() for t in tensors) for tensors in send]
    receive_sizes = [sum(math.prod(shape) for shape in shapes) for shapes in receive_shapes]
    flat_send = torch.cat([t.reshape(-1) for tensors in send for t in tensors])
    flat_receive = flat_send.new_empty(sum(receive_sizes))
    dist.all_to_all_single(flat_receive, flat_send, receive_sizes, send_sizes,
                           group=process_group)
    received, offset = [], 0
    for shapes in receive_shapes:
        received.append([])
        for shape in shapes:
            received[-1].append(flat_receive[offset:offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
    return received


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon (the same arguments, groups and state) for plain tensors and for FSDP2's
    row-sharded DTensors on a 1-D mesh: two all-to-alls a step per mesh, whatever the number of
    matrices (docs/training.md#muon)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every matrix with a gradient, in the same order on every rank, and its momentum update
        # (this rank's rows of it, for a DTensor).
        matrices, updates = [], []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                grad, buffer = local(param.grad), local(state["momentum_buffer"])
                buffer.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                matrices.append((param, group))
                updates.append(update)
        orthogonalized = self.orthogonalize(matrices, updates)
        for (param, group), update in zip(matrices, orthogonalized):
            lr, shard = group["lr"], local(param)
            shard.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay, at the group's lr
            shard.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss

    def orthogonalize(self, matrices, updates):
        """Newton-Schulz of each matrix's whole update, as this rank's rows of the result. Plain
        tensors are whole already; the sharded ones go through their mesh's two all-to-alls."""
        results = [None] * len(matrices)
        by_mesh = {}
        for i, ((param, group), update) in enumerate(zip(matrices, updates)):
            if isinstance(param, DTensor) and param.device_mesh.size() > 1:
                if param.device_mesh.ndim != 1 or param.placements != (Shard(0),):
                    raise ValueError(f"ShardedMuon: a {tuple(param.shape)} matrix laid out as "
                                     f"{param.placements} on {param.device_mesh}; it takes FSDP2's "
                                     "rows (Shard(0)) on a 1-D mesh")
                by_mesh.setdefault(param.device_mesh, []).append(i)
            else:
                results[i] = newton_schulz(update, group["ns_coefficients"], group["ns_steps"],
                                           group["eps"])
        for mesh, indices in by_mesh.items():
            orthogonal_rows = orthogonalize_sharded([matrices[i] for i in indices],
                                                    [updates[i] for i in indices], mesh.get_group())
            for i, rows in zip(indices, orthogonal_rows):
                results[i] = rows
        return results


def orthogonalize_sharded(matrices, updates, process_group):
    """This rank's rows of the Newton-Schulz of each (param, param group) in `matrices`, sharded by
    rows over `process_group`, from this rank's rows of its update. Newton-Schulz starts by
    rounding to bf16, so the rows travel in bf16 both ways: half the bytes, the same numbers."""
    rank, world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
    shapes = [tuple(param.shape) for param, _ in matrices]
    owners = assign_owners(shapes, world_size)
    row_ranges = [shard_rows(rows, world_size) for rows, _ in shapes]
    for (_, cols), ranges, update in zip(shapes, row_ranges, updates):
        first, end = ranges[rank]
        assert update.shape == (end - first, cols), "not FSDP2's rows of the matrix"
    owned_by = [[i for i, owner in enumerate(owners) if owner == r] for r in range(world_size)]

    # Every rank's rows of each matrix to the matrix's owner, which puts them together.
    send = [[updates[i].bfloat16() for i in owned_by[dest]] for dest in range(world_size)]
    receive_shapes = [[(row_ranges[i][source][1] - row_ranges[i][source][0], shapes[i][1])
                       for i in owned_by[rank]] for source in range(world_size)]
    received = all_to_all(send, receive_shapes, process_group)
    orthogonal = []
    for k, i in enumerate(owned_by[rank]):
        whole = torch.cat([received[source][k] for source in range(world_size)])
        group = matrices[i][1]
        orthogonal.append(newton_schulz(whole, group["ns_coefficients"], group["ns_steps"],
                                        group["eps"]))

    # Each rank's rows of the orthogonalized updates back to it.
    send = [[matrix[slice(*row_ranges[i][dest])] for i, matrix in zip(owned_by[rank], orthogonal)]
            for dest in range(world_size)]
    receive_shapes = [[tuple(updates[i].shape) for i in owned_by[source]]
                      for source in range(world_size)]
    received = all_to_all(send, receive_shapes, process_group)
    results = [None] * len(matrices)
    for source in range(world_size):
        for i, rows in zip(owned_by[source], received[source]):
            results[i] = rows
    return results


def local(tensor):
    """This rank's part of a DTensor, which in-place operations update; a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
