// ModelInfer through the mesh from Node.js, with stubs loaded from protos/ only.
// usage: node infer.js HOST:PORT MODEL INPUT_NAME OUTPUT_NAME 'JSON rows (FP32)'
// prints {"model_name", "model_version", "shape", "values"} as JSON.
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, model, inputName, outputName, rowsJson] = process.argv.slice(2);
const protos = path.resolve(__dirname, "..", "..", "protos");
const definition = loader.loadSync("inference/grpc_service.proto", {
  includeDirs: [protos], keepCase: true, longs: Number, enums: String, defaults: true,
});
const inference = grpc.loadPackageDefinition(definition).inference;
const client = new inference.GRPCInferenceService(target, grpc.credentials.createInsecure());

const rows = JSON.parse(rowsJson);
const flat = Float32Array.from(rows.flat());
const request = {
  model_name: model,
  inputs: [{ name: inputName, datatype: "FP32", shape: [rows.length, rows[0].length] }],
  outputs: [{ name: outputName }],
  raw_input_contents: [Buffer.from(flat.buffer)],
};
client.ModelInfer(request, { deadline: Date.now() + 30000 }, (error, response) => {
  if (error) {
    console.error(`ModelInfer failed: ${error.code} ${error.details}`);
    process.exit(1);
  }
  const raw = response.raw_output_contents[0];
  const values = Array.from(new Float32Array(raw.buffer, raw.byteOffset, raw.length / 4));
  console.log(JSON.stringify({
    model_name: response.model_name,
    model_version: response.model_version,
    shape: response.outputs[0].shape.map(Number),
    values,
  }));
  client.close();
});
