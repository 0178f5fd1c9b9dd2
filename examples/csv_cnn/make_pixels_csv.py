"""Write pixels.csv: one 8x8 grey image per row, `label,p0,...,p63` with pixels 0..16.

Stands in for your own data: scikit-learn's bundled digits, written out as a
user's export would look. Usage: python make_pixels_csv.py [OUT.csv]
"""
import csv
import sys

from sklearn.datasets import load_digits


def write_pixels_csv(path: str = "pixels.csv") -> None:
    digits = load_digits()
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label"] + [f"p{i}" for i in range(64)])
        for image, label in zip(digits.data, digits.target):
            writer.writerow([int(label)] + [int(v) for v in image])


if __name__ == "__main__":
    write_pixels_csv(*sys.argv[1:])
