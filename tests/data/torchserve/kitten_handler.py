"""A custom TorchServe handler, written as TorchServe's docs teach: BaseHandler's
initialize loads the TorchScript model and index_to_name.json; preprocess
decodes the photos of the batch, postprocess answers each with its top classes."""

import io

import numpy as np
import torch
from PIL import Image
from ts.torch_handler.base_handler import BaseHandler


class KittenHandler(BaseHandler):
    def preprocess(self, data):
        images = []
        for row in data:
            image = row.get("data") or row.get("body")
            picture = Image.open(io.BytesIO(image)).convert("RGB").resize((64, 64))
            pixels = np.asarray(picture, dtype=np.float32) / 255.0
            images.append(torch.from_numpy(pixels).permute(2, 0, 1))
        self.batch = len(images)
        return torch.stack(images)

    def postprocess(self, data):
        probabilities = torch.softmax(data, dim=1)
        top, classes = probabilities.topk(3, dim=1)
        answers = []
        for scores, indexes in zip(top.tolist(), classes.tolist(), strict=True):
            pairs = zip(scores, indexes, strict=True)
            answer = {self.mapping[str(i)]: round(p, 6) for p, i in pairs}
            answer["batch"] = self.batch
            answers.append(answer)
        return answers
