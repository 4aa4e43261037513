"""The names the examples in docs/*.md use for "your model, your data".

Any PyTorch model, optimizer and DataLoaders will do; these are small ones so
that the examples run as written (tests/docs/test_doc_blocks.py runs every
Python block of README.md and docs/*.md, each page's blocks in order, after
this file). A page that relies on these names says so at its top.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
_x, _y = torch.randn(256, 8), torch.randint(0, 3, (256,))
train_dataloader = DataLoader(TensorDataset(_x, _y), batch_size=32, shuffle=True)
eval_dataloader = test_loader = test_data = DataLoader(TensorDataset(_x[:64], _y[:64]), batch_size=32)
train, val, held_out = train_dataloader, eval_dataloader, eval_dataloader

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)

# two networks (a GAN): a generator from 64-d noise to 8-d "images", a discriminator
G = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
D = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
real_images = torch.randn(256, 8)

# a frozen teacher and its student
teacher = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
student = torch.nn.Linear(8, 3)
opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
