"""Solutions to the exercises of notebook 02 (02_model_parallel.ipynb).

They use what the notebook defined (GPT, gpipe, hybrid, lab): run them in its kernel after it ran,
`%run -i solutions/02_model_parallel.py`, then run the check cells again.
"""

import torch

# 1. At its peak GPipe's stage 0 holds all m microbatches, 1F1B's stage 0 holds p = 2 of
#    them; with the same batch in m = 16 pieces each piece is half as large, so the ratio is
#    m / p = 16 / 2 (it was 8 / 2 at m = 8).
answer_1 = 16 / 2


# 2. The measured bubble: idle over the whole span of each stage's steps, after warm-up.
def measured_bubble(result, skip=2):
    busy, idle = {}, {}
    for record in result.metrics:
        values = record.values
        if "idle(s)" not in values or record.step <= skip:
            continue
        work = values["busy/forward(s)"] + values["busy/backward(s)"]
        busy[record.rank] = busy.get(record.rank, 0.0) + work
        idle[record.rank] = idle.get(record.rank, 0.0) + values["idle(s)"]
    shares = [idle[rank] / (idle[rank] + busy[rank]) for rank in idle]
    return sum(shares) / len(shares)


answer_2 = measured_bubble(gpipe)  # noqa: F821


# 3. One process: the cell after the seed, the contract's sample order, one step per batch.
def one_process(config=hybrid.config):  # noqa: F821
    ns = {}
    torch.manual_seed(config.seed)
    exec(GPT, ns)  # noqa: F821
    model, dataset, loss_fn = ns["model"], ns["dataset"], ns["loss_fn"]
    optimizer = ns["make_optimizer"](model.parameters())
    batch = config.batch_size
    for epoch in range(config.epochs):
        seeded = torch.Generator().manual_seed(config.seed + epoch)
        order = torch.randperm(len(dataset), generator=seeded)
        for b in range(len(dataset) // batch):
            x, y = dataset[order[b * batch : (b + 1) * batch]]
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


answer_3 = one_process()


# 4. The lab's GPipe points on p = 2, in increasing m: the first whose measured idle share is
#    under 0.6 x the share measured at m = 1 (0 when none is).
def first_m_under(points, *, share_of_m1=0.6):
    gpipe_2 = sorted(
        (pt for pt in points if pt.partitions == 2 and pt.schedule == "gpipe"),
        key=lambda pt: pt.microbatches,
    )
    limit = share_of_m1 * gpipe_2[0].idle_share  # the sweep's first m is 1
    return next((pt.microbatches for pt in gpipe_2 if pt.idle_share < limit), 0)


answer_4 = first_m_under(lab)  # noqa: F821
