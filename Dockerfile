# CPU image of deepinfer (the embedded default). GPU images add the `nvidia` extra on a CUDA base.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY proto ./proto
RUN pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir ".[otlp]"
ENV DEEPINFER_ACCELERATOR=cpu DEEPINFER_CACHE_DIR=/cache
VOLUME ["/cache"]
ENTRYPOINT ["deepinfer"]
CMD ["up", "--host", "0.0.0.0"]
