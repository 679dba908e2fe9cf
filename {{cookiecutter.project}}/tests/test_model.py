"""The models (model.py): output shapes for the configured image sizes, and a built model that trains."""

import pytest
import torch

from {{ cookiecutter.package }}.model import SmallCNN, resnet18


@pytest.mark.parametrize("image_size", [16, 32, 61])
def test_small_cnn_gives_one_logit_per_class_at_any_size(image_size):
    model = SmallCNN(num_classes=5, width=8)
    assert model(torch.randn(3, 3, image_size, image_size)).shape == (3, 5)


def test_small_cnn_width_and_channels():
    model = SmallCNN(num_classes=2, width=4, in_channels=1)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 2)
    assert model.head.in_features == 16


def test_resnet18_shape_and_fresh_weights():
    torch.manual_seed(0)
    a = resnet18(num_classes=7)
    assert a(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    torch.manual_seed(1)
    b = resnet18(num_classes=7)
    assert not torch.equal(a.conv1.weight, b.conv1.weight)  # randomly initialised, not downloaded weights


def test_one_step_moves_the_weights():
    model = SmallCNN(num_classes=4, width=4)
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
